"""kvjax: long-context LLM inference under a fixed KV-cache budget, in JAX.

  lm = kvjax.load("smollm2-135m-instruct")
  result = kvjax.generate(lm, ["..."], policy="full", max_new_tokens=32)

The names below load on first use, so ``import kvjax.cache`` (or
``kvjax.kernels``) brings in the cache (or the kernels) alone, not the models,
policies and generation. ``kvjax.runtime.setup()`` is the opt-in process set-up
the command-line tools run (``kvjax/runtime.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_NAMES = {
    "GenerationResult": "kvjax.generation",
    "GenerationStats": "kvjax.generation",
    "generate": "kvjax.generation",
    "generate_each": "kvjax.generation",
    "CompressedContext": "kvjax.generation",
    "answer": "kvjax.generation",
    "compress": "kvjax.generation",
    "load_cache": "kvjax.generation",
    "save_cache": "kvjax.generation",
    "LanguageModel": "kvjax.models.lm",
    "init_random": "kvjax.models.lm",
    "load": "kvjax.models.lm",
    "LlamaConfig": "kvjax.models.config",
    "RopeScaling": "kvjax.models.config",
    "PagedKVCache": "kvjax.cache",
    "causal_attention": "kvjax.cache",
    "decode_attention": "kvjax.cache",
    "prefill_attention": "kvjax.cache",
}
# Public submodules.
_MODULES = ("backend", "buffer_memory", "execution", "policies", "runtime", "sharding", "tasks")
# Subpackages that ``import kvjax`` once made attributes as a side effect.
_PACKAGES = ("cache", "generation", "kernels", "models")

__all__ = sorted([*_NAMES, *_MODULES])

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
  from kvjax import backend, buffer_memory, execution, policies, runtime, sharding, tasks
  from kvjax.cache import PagedKVCache, causal_attention, decode_attention, prefill_attention
  from kvjax.generation import GenerationResult, GenerationStats, generate, generate_each
  from kvjax.generation import CompressedContext, answer, compress, load_cache, save_cache
  from kvjax.models.config import LlamaConfig, RopeScaling
  from kvjax.models.lm import LanguageModel, init_random, load


def __getattr__(name: str):
  if name in _NAMES:
    value = getattr(importlib.import_module(_NAMES[name]), name)
  elif name in _MODULES or name in _PACKAGES:
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__() -> list[str]:
  return sorted({*__all__, *_PACKAGES, "__version__"})
