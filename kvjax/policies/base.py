"""What every eviction policy provides to generation.

A policy is a frozen dataclass (hashable, so jit treats it as static). It says
how many slots each (layer, KV head) needs for a static budget, which prompt
tokens to keep at prefill (a ``select`` function handed to the cache's
attention entry point) and what to do before each decode step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from kvjax.cache import attention as attention_lib
from kvjax.cache.paged import PagedKVCache, round_up


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base class. Subclasses set ``name`` and override what they change."""

  name: ClassVar[str] = ""

  def capacity(self, *, budget: int | None, prompt_len: int, max_new_tokens: int,
               page_size: int, num_layers: int, num_kv_heads: int):
    """Slots per (layer, KV head): an int, [L] or [L][K], each a multiple of page_size."""
    raise NotImplementedError

  def select(self, budget: int | None) -> attention_lib.SelectFn:
    """The prefill keep rule: select(layer, q, k, v, positions, lengths) -> slots [B, K, T]."""
    return attention_lib.keep_all

  def before_decode_step(self, cache: PagedKVCache, budget: int | None) -> PagedKVCache:
    """Runs before each decode step's append (decode-time eviction). Default: nothing."""
    del budget
    return cache


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """No eviction: every prompt and generated token stays in the cache."""

  name: ClassVar[str] = "full"

  def capacity(self, *, budget, prompt_len, max_new_tokens, page_size, num_layers,
               num_kv_heads):
    if budget is not None:
      raise ValueError(f"the full policy keeps every token; budget must be None, got {budget}")
    return round_up(prompt_len + max_new_tokens, page_size)
