"""Efficient Streaming Language Models with Attention Sinks (StreamingLLM, arXiv 2309.17453).

Each head keeps the first tokens (attention sinks, which soak up attention
whatever their content) and the most recent ones; while decoding, a full head
gives up its oldest non-sink, so the cache stays at the budget.

Parameters:
  n_sink   4   first tokens always kept, counted in the budget (the paper's and kvpress's)

Ours where the paper is silent: keys keep the RoPE rotation of their original
positions (kvpress's default; the paper re-assigns positions inside the
cache), and the rest of the budget is the recent window (budget - n_sink).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies import decode
from kvjax.policies import selection
from kvjax.policies.base import Policy


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
  """Attention sinks + the most recent tokens; evicts the oldest non-sink while decoding."""

  name: ClassVar[str] = "streaming_llm"
  n_sink: int = 4  # first tokens always kept

  def __post_init__(self):
    self._check_int("n_sink", 0)

  def reserved(self):
    return self.n_sink

  @property
  def decode(self):
    return decode.EvictToken(self.evict_slot)

  def score(self, ex, prompt, q, k, v):
    """Sinks score T (first), then recency (the position): [B, K, T]; padding -inf."""
    del ex
    pos = prompt.positions.astype(jnp.float32)
    t = pos.shape[1]
    scores = jnp.where(pos < self.n_sink, float(t), pos)  # sinks first, then recency
    scores = jnp.where(jnp.arange(t)[None] < prompt.lengths[:, None], scores, -jnp.inf)
    return jnp.broadcast_to(scores[:, None], (k.shape[0], k.shape[2], t))

  def evict_slot(self, ex, cache, positions):
    """[B, L, K] the slot of each head's oldest non-sink."""
    del ex
    pos = selection.slot_view(cache, cache.positions)
    candidate = selection.filled_slots(cache) & (pos >= self.n_sink)
    return jnp.argmin(jnp.where(candidate, pos, jnp.iinfo(jnp.int32).max), axis=-1)
