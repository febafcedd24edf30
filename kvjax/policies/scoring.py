"""Scoring stages: how important each prompt token is, per (sequence, KV head).

Every scorer returns float32 scores [B, K, T] (higher = keep) and works on the
prompt of one layer as the model computed it (q: [B, T, N, H], k/v: [B, T, K, H],
RoPE applied). Right padding: positions >= lengths[b] are not prompt tokens.
Keys and values are never repeated per query head: query heads are grouped
(n // G is the KV head of query head n) and their scores reduced per group.
Kernel ops run as ``ex.impl(op)``, reductions over KV heads as ``ex.axes.*``
(``ex``: the program's ``kvjax.execution.Execution``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The scoring math is defined once, beside its Pallas kernel; these names are
# this module's public stages.
from kvjax.kernels.window_scoring import GROUP_REDUCTIONS
from kvjax.kernels.window_scoring import attention_received
from kvjax.kernels.window_scoring import avg_pool
from kvjax.kernels.window_scoring import reduce_group
from kvjax.policies import selection


@dataclasses.dataclass(frozen=True)
class WindowScorer:
  """SnapKV's observation-window scorer, as the window-scored policies compose it.

  The prompt is ``compressible prefix | observation window``: the last
  ``window`` tokens' queries score the tokens before them (window-averaged
  attention, average-pooled over ``kernel`` tokens, reduced over each KV
  head's query heads by ``group``). Policies get one from their fields
  (``fields.WindowFields.scorer``).
  """

  window: int
  kernel: int = 5
  group: str = "mean"

  def scores(self, ex, q, k, lengths) -> jax.Array:
    """SnapKV's token scores [B, K, T]: the window scores max + 1, padding -inf."""
    return snapkv_scores(ex, q, k, lengths, window=self.window, kernel=self.kernel,
                         group=self.group)

  def prefix_scores(self, ex, q, k, lengths) -> tuple[jax.Array, jax.Array]:
    """The scores of the compressible prefix alone, and its attention density.

    Returns (scores [B, K, T], density [B, T]), float32, zero outside the
    prefix: ``scores`` is SnapKV's token score; ``density`` is the unpooled
    attention averaged over every query head (one number per token for the
    whole layer).
    """
    raw = snapkv_scores(ex, q, k, lengths, window=self.window, kernel=1, group=self.group)
    prefix, _ = selection.regions(lengths, k.shape[1], self.window)
    raw = jnp.where(prefix[:, None], raw, 0.0)
    # Mean and pooling are linear, so pooling the group mean equals SnapKV's
    # pool-then-reduce for group="mean"; for "max" it pools the maximum.
    scores = jnp.where(prefix[:, None], avg_pool(raw, self.kernel), 0.0)
    return scores, ex.axes.heads_mean(raw, 1)


def snapkv_scores(ex, q, k, lengths, *, window: int, kernel: int, group: str = "mean") -> jax.Array:
  """SnapKV token scores [B, K, T] (kvpress's SnapKVPress.score, for a right-padded batch).

  The last ``window`` queries attend causally over the whole prompt; their
  weights on the tokens before the window are averaged over the window,
  average-pooled per query head, then reduced over each KV head's group. The
  window tokens score max + 1 (always kept); padding scores -inf. Computed by
  ``ex``'s ``window_scores`` (the XLA reference or the Pallas kernel).
  """
  scores = ex.impl("window_scores")(q, k, lengths, window=window, pool=kernel, group=group)
  return force_window(ex, scores, lengths, window)


def force_window(ex, scores: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
  """Gives the last ``window`` tokens of each sequence the score max + 1, padding -inf.

  The max is taken over the sequence's own finite prefix scores (all heads),
  so sequences of a batch do not influence each other, and a NaN or Inf
  score in one head cannot pull the window below another head's scores.
  """
  t = scores.shape[-1]
  key_pos = jnp.arange(t)[None, None, :]
  start = (lengths - window)[:, None, None]
  end = lengths[:, None, None]
  prefix = key_pos < start
  top = ex.axes.heads_max(jnp.where(prefix & jnp.isfinite(scores), scores, -jnp.inf),
                          axis=(1, 2), keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  scores = jnp.where(prefix, scores, top + 1.0)
  return jnp.where(key_pos < end, scores, -jnp.inf)


def mask_padding(scores: jax.Array, lengths: jax.Array) -> jax.Array:
  """Scores [B, K, T] with -inf past each sequence's length (padding is never kept)."""
  valid = jnp.arange(scores.shape[-1])[None, None] < lengths[:, None, None]
  return jnp.where(valid, scores, -jnp.inf)


def key_norm_scores(ex, k: jax.Array) -> jax.Array:
  """-||k||_2 per token and KV head: [B, T, K, H] -> [B, K, T] (KnormPress keeps low norms)."""
  return -ex.impl("token_norms")(k)


def accumulated_attention(q, k, lengths, *, block: int = 256, group: str = "mean") -> jax.Array:
  """H2O's prefill score: attention each key receives, summed over every prompt query.

  Computed in blocks of ``block`` queries (no T x T matrix). Returns [B, K, T].
  """
  b, t, n, h = q.shape
  c = min(block, t)
  num_blocks = -(-t // c)
  qp = jnp.pad(q, ((0, 0), (0, num_blocks * c - t), (0, 0), (0, 0)))

  def one_block(total, i):
    rows = jax.lax.dynamic_slice_in_dim(qp, i * c, c, axis=1)
    pos = jnp.broadcast_to(i * c + jnp.arange(c), (b, c))
    return total + attention_received(rows, pos, pos < lengths[:, None], k, lengths), None

  total, _ = jax.lax.scan(one_block, jnp.zeros((b, n, t), jnp.float32), jnp.arange(num_blocks))
  return reduce_group(total, k.shape[2], group)
