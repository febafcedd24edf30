"""The passkey retrieval prompt: a number hidden at a chosen depth of repeated filler.

The single-needle ``niah`` task on the "repeat" haystack, in the format on
which SmolLM2-135M-Instruct retrieves the key with the full cache (measured:
100% at 1K-4K tokens).
"""

from __future__ import annotations

from kvjax.tasks import niah
from kvjax.tasks.sample import Sample


def passkey_prompt(tokenizer, *, context_tokens: int, depth: float = 0.5, seed: int = 0) -> Sample:
  """A passkey prompt of about ``context_tokens`` tokens (never more).

  Args:
    tokenizer: a kvjax Tokenizer (uses ``encode`` and ``chat``).
    context_tokens: target prompt length in tokens, markup included.
    depth: needle position as a fraction of the filler, 0 (start) to 1 (end).
    seed: picks the 5-digit key.
  """
  return niah.make_sample(tokenizer, "niah", length=context_tokens, depth=depth,
                          haystack="repeat", seed=seed)
