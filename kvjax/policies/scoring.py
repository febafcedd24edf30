"""Scoring stages: how important each prompt token is, per (sequence, KV head).

Every scorer returns float32 scores [B, K, T] (higher = keep) and works on the
prompt of one layer as the model computed it (q: [B, T, N, H], k/v: [B, T, K, H],
RoPE applied). Right padding: positions >= lengths[b] are not prompt tokens.
Keys and values are never repeated per query head: query heads are grouped
(n // G is the KV head of query head n) and their scores reduced per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP_REDUCTIONS = ("mean", "max")


def reduce_group(scores: jax.Array, num_kv_heads: int, how: str = "mean") -> jax.Array:
  """[B, N, T] per query head -> [B, K, T] per KV head (mean or max over the group)."""
  if how not in GROUP_REDUCTIONS:
    raise ValueError(f"group reduction must be one of {GROUP_REDUCTIONS}, got {how!r}")
  b, n, t = scores.shape
  grouped = scores.reshape(b, num_kv_heads, n // num_kv_heads, t)
  return grouped.mean(2) if how == "mean" else grouped.max(2)


def attention_received(q_rows: jax.Array, row_pos: jax.Array, row_valid: jax.Array,
                       k: jax.Array, lengths: jax.Array) -> jax.Array:
  """Sum over query rows of the softmax weight each key receives.

  Each row attends causally over the whole prompt (keys at positions <= its
  own, and < the sequence length), softmax in float32 over all those keys.

  Args:
    q_rows: [B, R, N, H] queries; row_pos: [B, R] their positions;
    row_valid: [B, R] bool, rows that count.
    k: [B, T, K, H]; lengths: [B].

  Returns:
    [B, N, T] float32.
  """
  b, r, n, h = q_rows.shape
  t, kh = k.shape[1], k.shape[2]
  qg = q_rows.astype(jnp.float32).reshape(b, r, kh, n // kh, h)
  logits = jnp.einsum("brkgh,btkh->bkgrt", qg, k.astype(jnp.float32)) * (h ** -0.5)
  key_pos = jnp.arange(t)
  visible = (key_pos[None, None, :] <= row_pos[:, :, None]) & (
      key_pos[None, None, :] < lengths[:, None, None])  # [B, R, T]
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=-1)
  weights = jnp.where(row_valid[:, None, None, :, None], weights, 0.0)
  return weights.sum(3).reshape(b, n, t)


def window_queries(q: jax.Array, lengths: jax.Array, window: int):
  """The last ``window`` prompt queries of each sequence.

  Returns (rows [B, W, N, H], positions [B, W], valid [B, W]); a sequence
  shorter than the window has invalid leading rows.
  """
  pos = lengths[:, None] - window + jnp.arange(window)[None, :]  # [B, W]
  rows = jnp.take_along_axis(q, jnp.maximum(pos, 0)[:, :, None, None], axis=1)
  return rows, pos, pos >= 0


def avg_pool(scores: jax.Array, kernel: int) -> jax.Array:
  """1-D average pooling over T, stride 1, zero padding, divided by the kernel size.

  (What torch's avg_pool1d(padding=kernel // 2) computes; kernel must be odd.)
  """
  if kernel <= 1:
    return scores
  if kernel % 2 == 0:
    raise ValueError(f"pooling kernel must be odd, got {kernel}")
  half = kernel // 2
  t = scores.shape[-1]
  padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)])
  return sum(padded[..., i:i + t] for i in range(kernel)) / kernel


def snapkv_scores(q, k, lengths, *, window: int, kernel: int, group: str = "mean") -> jax.Array:
  """SnapKV token scores [B, K, T] (kvpress's SnapKVPress.score, for a right-padded batch).

  The last ``window`` queries attend causally over the whole prompt; their
  weights on the tokens before the window are averaged over the window,
  average-pooled per query head, then reduced over each KV head's group. The
  window tokens score max + 1 (always kept); padding scores -inf.
  """
  rows, pos, valid = window_queries(q, lengths, window)
  received = attention_received(rows, pos, valid, k, lengths) / window  # [B, N, T]
  t = k.shape[1]
  key_pos = jnp.arange(t)[None, :]
  prefix = key_pos < (lengths - window)[:, None]  # [B, T]
  received = jnp.where(prefix[:, None, :], received, 0.0)
  scores = reduce_group(avg_pool(received, kernel), k.shape[2], group)
  return force_window(scores, lengths, window)


def force_window(scores: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
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
  top = jnp.max(jnp.where(prefix & jnp.isfinite(scores), scores, -jnp.inf), axis=(1, 2),
                keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  scores = jnp.where(prefix, scores, top + 1.0)
  return jnp.where(key_pos < end, scores, -jnp.inf)


def key_norm_scores(k: jax.Array) -> jax.Array:
  """-||k||_2 per token and KV head: [B, T, K, H] -> [B, K, T] (KnormPress keeps low norms)."""
  return -jnp.swapaxes(jnp.linalg.norm(k.astype(jnp.float32), axis=-1), 1, 2)


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
