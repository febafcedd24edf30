"""kvjax: long-context LLM inference under a fixed KV-cache budget, in JAX.

  lm = kvjax.load("smollm2-135m-instruct")
  result = kvjax.generate(lm, ["..."], policy="full", max_new_tokens=32)
"""

from kvjax import buffer_memory
from kvjax import policies
from kvjax import tasks
from kvjax.cache import PagedKVCache
from kvjax.cache import causal_attention
from kvjax.cache import decode_attention
from kvjax.cache import prefill_attention
from kvjax.generation import GenerationResult
from kvjax.generation import GenerationStats
from kvjax.generation import generate
from kvjax.generation import generate_each
from kvjax.models.config import LlamaConfig
from kvjax.models.config import RopeScaling
from kvjax.models.lm import LanguageModel
from kvjax.models.lm import init_random
from kvjax.models.lm import load

__version__ = "0.1.0"

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "LanguageModel",
    "LlamaConfig",
    "PagedKVCache",
    "RopeScaling",
    "buffer_memory",
    "causal_attention",
    "decode_attention",
    "generate",
    "generate_each",
    "init_random",
    "load",
    "policies",
    "prefill_attention",
    "tasks",
]
