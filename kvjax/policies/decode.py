"""Decode rules: what a policy does to the cache before each decode step's append.

  Keep           nothing: each head takes one slot per new token (SnapKV and most)
  EvictToken     a head at its limit gives up one token (StreamingLLM, H2O)
  EvictPage      a head past its limit with a full tail page gives up one page (PagedEviction)

A rule also says how many entries a head takes while decoding (``growth``),
which is what the layout sizes beyond the budget. Dimension letters: B batch,
L layers, K KV heads.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.paged import EMPTY


@dataclasses.dataclass(frozen=True)
class Keep:
  """Nothing is evicted while decoding."""

  evicts: ClassVar[bool] = False

  def growth(self, max_new_tokens: int) -> int:
    """Entries a head takes while decoding, beyond its budget and question."""
    return max_new_tokens

  def before_step(self, ex, cache, limit, positions, question):
    """The cache before the append of the token at ``positions`` [B]; ``limit`` [B, L, K]."""
    del ex, limit, positions, question
    return cache


@dataclasses.dataclass(frozen=True)
class EvictToken(Keep):
  """A head at its limit gives up ``slot(ex, cache, positions)`` [B, L, K], so it stays there."""

  slot: Callable
  evicts: ClassVar[bool] = True

  def growth(self, max_new_tokens):
    return 0

  def before_step(self, ex, cache, limit, positions, question):
    del question
    full = cache.lengths >= limit
    return cache.remove(jnp.where(full, self.slot(ex, cache, positions), EMPTY), ex=ex)


@dataclasses.dataclass(frozen=True)
class EvictPage(Keep):
  """A head past its limit whose tail page is full gives up the page
  ``page(ex, cache, question)`` [B, L, K] (-1: none may go): a page-table edit.

  The prototype appends, then evicts once past the budget with the tail page
  full; evicting at the start of the next step attends over the same entries
  at every step and needs no second hook.
  """

  page: Callable
  page_size: int
  evicts: ClassVar[bool] = True

  def growth(self, max_new_tokens):
    # A head holds at most its budget and question + 1 before it evicts (the
    # decode loop appends max_new_tokens - 1 tokens: the last is never stored).
    return min(max_new_tokens - 1, 1)

  def check(self, page_size: int) -> None:
    if page_size != self.page_size:
      raise ValueError(f"policy 'paged_eviction' has page_size={self.page_size} but the cache "
                       f"has page_size={page_size}; set both to the same value")

  def before_step(self, ex, cache, limit, positions, question):
    del positions
    self.check(cache.page_size)
    full = (cache.lengths > limit) & (cache.lengths % cache.page_size == 0)

    def evict(cache):
      return cache.drop_pages(jnp.where(full, self.page(ex, cache, question), EMPTY), ex=ex)

    # A page goes once every page_size steps: skip the scoring otherwise. On a
    # mesh every shard takes the same branch (the branch holds collectives).
    return jax.lax.cond(ex.axes.any_anywhere(full), evict, lambda c: c, cache)

