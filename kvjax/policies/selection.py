"""Selection stages: which tokens a head keeps under a static budget, and where they go.

A keep mask [B, K, T] becomes slots [B, K, T]: kept tokens fill slots 0, 1, ...
in their original order, dropped tokens get -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.paged import EMPTY


def keep_top(scores: jax.Array, budget, max_budget: int) -> jax.Array:
  """Keeps the ``budget`` highest-scoring tokens per (sequence, head).

  Args:
    scores: [B, K, T] float32; -inf marks tokens that must not be kept (padding).
      NaN scores rank lowest, so they never displace a real score.
    budget: kept entries per head, an int or a traced scalar <= max_budget.
    max_budget: static upper bound of ``budget``.

  Returns:
    bool [B, K, T].
  """
  t = scores.shape[-1]
  k = min(max_budget, t)
  clean = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
  values, index = jax.lax.top_k(clean, k)  # [B, K, k]
  take = (jnp.arange(k) < budget) & (values > -jnp.inf)
  keep = jnp.zeros(scores.shape, bool)
  b_idx = jnp.arange(scores.shape[0])[:, None, None]
  h_idx = jnp.arange(scores.shape[1])[None, :, None]
  return keep.at[b_idx, h_idx, index].max(take)


def slots_from_keep(keep: jax.Array) -> jax.Array:
  """bool [B, K, T] -> int32 slots [B, K, T], original order, -1 where dropped."""
  rank = jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1
  return jnp.where(keep, rank, EMPTY)


def segment_ids(boundary_after: jax.Array) -> jax.Array:
  """bool [B, T] (a segment ends after this token) -> int32 segment id [B, T] from 0."""
  starts = jnp.pad(boundary_after[:, :-1], ((0, 0), (1, 0)))
  return jnp.cumsum(starts, axis=-1, dtype=jnp.int32)


def segment_mean(scores: jax.Array, seg: jax.Array, valid: jax.Array) -> jax.Array:
  """Mean score of each token's segment, broadcast back to tokens.

  Args:
    scores: [B, K, T]; seg: [B, T] segment ids < T; valid: [B, T] tokens that count.

  Returns:
    [B, K, T] float32; tokens in segments without valid tokens get -inf.
  """
  b, kh, t = scores.shape
  flat = (jnp.arange(b)[:, None] * t + seg).reshape(-1)  # a segment id per (b, token)
  x = jnp.where(valid[:, None], scores, 0.0).transpose(0, 2, 1).reshape(b * t, kh)
  sums = jax.ops.segment_sum(x, flat, num_segments=b * t)  # [(B T_seg), K]
  counts = jax.ops.segment_sum(valid.reshape(-1).astype(jnp.float32), flat, num_segments=b * t)
  mean = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], -jnp.inf)
  return mean[flat].reshape(b, t, kh).transpose(0, 2, 1)
