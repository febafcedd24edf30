"""H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models
(arXiv 2306.14048).

A few tokens ("heavy hitters") receive most of the attention: each head
keeps the tokens with the largest accumulated attention plus the most recent
ones, and while decoding adds each step's attention to the scores and evicts
the lowest-scoring token outside the recent window, so the cache stays at the
budget.

Parameters:
  recent   32      most recent tokens always kept, counted in the budget
  group    "mean"  reduction over the query heads of a KV head ("mean" or "max")

Ours where the paper is silent: the prefill score is the attention each key
receives summed over every prompt query (computed blockwise, no T x T
matrix) and, being the same at every budget, shared by the runs of one
recorded prompt (``shares_scores``); ``recent`` is a fixed count, where the
paper splits the budget half and half (set ``recent=budget // 2`` for that);
kvpress has no H2O press (its ObservedAttentionPress is related).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies import decode
from kvjax.policies import scoring
from kvjax.policies import selection
from kvjax.policies.base import Policy


@dataclasses.dataclass(frozen=True)
class H2O(Policy):
  """Heavy hitters (accumulated attention) + a recent window; evicts one token per decode step."""

  name: ClassVar[str] = "h2o"
  chunked_prefill: ClassVar[bool] = False  # scores with every prompt query
  accumulates_attention: ClassVar[bool] = True
  shares_scores: ClassVar[bool] = True  # its score is a second attention pass
  recent: int = 32  # most recent tokens always kept (H2O's recent window)
  group: str = "mean"  # reduction over the query heads of a KV head

  def __post_init__(self):
    self._check_int("recent", 0)
    self._check_choice("group", scoring.GROUP_REDUCTIONS)

  def reserved(self):
    return self.recent

  @property
  def decode(self):
    return decode.EvictToken(self.evict_slot)

  def score(self, ex, prompt, q, k, v):
    """s[b, h, t] = reduce_{n in group h} sum_{i >= t} softmax_t(q[b, i, n] . k[b, :, h] /
    sqrt(H)): the attention key t receives from every prompt query, [B, K, T]."""
    del ex
    acc = scoring.accumulated_attention(q, k, prompt.lengths, group=self.group)
    # The recent window is kept by selection, but the stored score stays the true sum.
    return scoring.mask_padding(acc, prompt.lengths)

  def keep(self, ex, scores, prompt, budget, max_budget):
    return selection.keep_top(scoring.force_window(ex, scores, prompt.lengths, self.recent),
                              budget, max_budget)

  def evict_slot(self, ex, cache, positions):
    """[B, L, K] each head's lowest accumulated attention outside the recent window."""
    del ex
    pos = selection.slot_view(cache, cache.positions)
    acc = selection.slot_view(cache, cache.scores)
    recent = pos > (positions[:, None, None, None] - 1 - self.recent)
    candidate = selection.filled_slots(cache) & ~recent
    return jnp.argmin(jnp.where(candidate, acc, jnp.inf), axis=-1)
