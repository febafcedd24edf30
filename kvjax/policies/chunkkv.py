"""ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference
(arXiv 2502.00299).

Tokens are kept in whole chunks, so a phrase survives whole or not at all:
the prompt is cut into chunks of ``chunk_length`` tokens from position 0,
each chunk is scored by the mean of its tokens' SnapKV scores summed over
the layer's KV heads, and the best chunks are kept, one index set for every
head of the layer.

Parameters:
  chunk_length  20      tokens per chunk (kvpress's default)
  window        64      SnapKV's observation window (scores the chunks)
  kernel        5       SnapKV's pooling width
  group         "mean"  reduction over the query heads of a KV head

Ours where the paper is silent or we differ from kvpress's ChunkKVPress
(docs/policies.md): budget // chunk_length chunks are kept, so at most the
budget (kvpress keeps int(num_chunks x (1 - ratio)) chunks; the two agree
when the prompt length is a multiple of chunk_length); the last chunk may be
short and scores by its own mean; the window is not forced: its max + 1
scores lift the chunks that hold it. The paper's layer-wise index reuse is
not done.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies import selection
from kvjax.policies.base import Policy
from kvjax.policies.fields import WindowFields


@dataclasses.dataclass(frozen=True)
class ChunkKV(WindowFields, Policy):
  """Whole chunks of tokens by mean score; one index set for all heads of a layer."""

  name: ClassVar[str] = "chunkkv"
  chunked_prefill: ClassVar[bool] = False  # chunks are spans of positions
  chunk_length: int = 20  # tokens per chunk

  def __post_init__(self):
    super().__post_init__()
    self._check_int("chunk_length", 1)

  def validate(self, budget):
    super().validate(budget)
    if budget < self.chunk_length:
      raise ValueError(f"budget {budget} is below one chunk of {self.chunk_length} tokens")

  def keep(self, ex, scores, prompt, budget, max_budget):
    b, kh, t = scores.shape
    c = self.chunk_length
    num_chunks = -(-t // c)
    valid = jnp.arange(t)[None] < prompt.lengths[:, None]  # [B, T]
    summed = jnp.where(valid, ex.axes.heads_sum(scores, 1), 0.0)  # [B, T], over KV heads
    pad = num_chunks * c - t
    chunk_sum = jnp.pad(summed, ((0, 0), (0, pad))).reshape(b, num_chunks, c).sum(-1)
    chunk_len = jnp.pad(valid, ((0, 0), (0, pad))).reshape(b, num_chunks, c).sum(-1)
    chunk_score = jnp.where(chunk_len > 0, chunk_sum / jnp.maximum(chunk_len, 1), -jnp.inf)
    n_keep = max(1, max_budget // c)
    chosen = selection.keep_top(chunk_score[:, None], jnp.maximum(budget // c, 1), n_keep)[:, 0]
    keep = jnp.repeat(chosen, c, axis=-1)[:, :t] & valid  # [B, T]
    return jnp.broadcast_to(keep[:, None], scores.shape)
