"""Long-context task generators (prompts with known answers)."""

from kvjax.tasks.passkey import Sample
from kvjax.tasks.passkey import passkey_prompt

__all__ = ["Sample", "passkey_prompt"]
