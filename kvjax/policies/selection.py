"""Selection stages: which tokens a head keeps under a static budget, and where they go.

A keep mask [B, K, T] becomes slots [B, K, T]: kept tokens fill slots 0, 1, ...
in their original order, dropped tokens get -1. Besides top-k, the stages of
the segment- and block-based policies: segments (ids, starts, sums, means),
whole units in score order while they fit, and topping a keep mask up to
exactly the budget. Dimension letters: B batch, K KV heads, T tokens, U units
(segments, blocks).
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
    budget: kept entries per head <= max_budget: an int, a traced scalar, or
      one per head, [B, K] (``head_budgets``) or [B, K, 1].
    max_budget: static upper bound of ``budget``.

  Returns:
    bool [B, K, T].
  """
  t = scores.shape[-1]
  k = min(max_budget, t)
  clean = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
  values, index = jax.lax.top_k(clean, k)  # [B, K, k]
  take = (jnp.arange(k) < _per_head(budget)) & (values > -jnp.inf)
  keep = jnp.zeros(scores.shape, bool)
  b_idx = jnp.arange(scores.shape[0])[:, None, None]
  h_idx = jnp.arange(scores.shape[1])[None, :, None]
  return keep.at[b_idx, h_idx, index].max(take)


def _per_head(budget):
  """A budget broadcastable against [B, K, n]: one per head [B, K] gains an axis."""
  budget = jnp.asarray(budget)
  return budget[..., None] if budget.ndim == 2 else budget


def head_budgets(scores: jax.Array, total, floor, max_total: int) -> jax.Array:
  """Splits a layer's ``total`` entries across its KV heads where the scores concentrate (AdaKV).

  Every head first takes its ``floor`` best tokens; the rest of ``total`` goes
  to the best remaining scores of all the layer's heads at once, so a head
  whose attention concentrates on few tokens gives entries to one whose
  attention is spread. Scores must be comparable across heads (attention
  weights are: each query's sum to one).

  Args:
    scores: [B, K, T]; -inf (or NaN) marks tokens that must not be kept.
    total: entries of the layer, an int or a traced scalar <= ``max_total``.
    floor: entries every head keeps at least, an int or a traced scalar
      (K * floor <= total).
    max_total: static upper bound of ``total``.

  Returns:
    int32 [B, K]: each head's budget, summing to ``total`` (fewer where the
    prompt has fewer tokens to keep).
  """
  b, kh, t = scores.shape
  clean = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
  first = keep_top(clean, floor, min(max_total, t))
  rest = jnp.where(first, -jnp.inf, clean).reshape(b, 1, kh * t)
  extra = keep_top(rest, total - kh * floor, max_total).reshape(b, kh, t)
  return (first | extra).sum(-1, dtype=jnp.int32)


def whole_pages(tokens: jax.Array, pages, page_size: int, grow: int) -> jax.Array:
  """Rounds each head's budget so the layer's heads fill exactly ``pages`` pages.

  Head h needs ``tokens[h] + grow`` slots (its kept entries, then what it takes
  after prefill): it gets their whole pages, and the layer's pages left over go
  one each to the heads that need most of a further page.

  Args:
    tokens: int32 [B, K] the heads' budgets (``head_budgets``), summing to at
      most ``pages x page_size - K x grow``.
    pages: the layer's pages, an int or a traced scalar.

  Returns:
    int32 [B, K]: budgets b_h with sum_h (b_h + grow) / page_size <= pages, each
    (b_h + grow) a whole number of pages.
  """
  need = tokens + grow
  whole = need // page_size
  part = need - whole * page_size
  spare = pages - whole.sum(-1, keepdims=True)
  order = jnp.argsort(-part, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)  # 0 for the head with most of a page to fill
  return (whole + ((rank < spare) & (part > 0))) * page_size - grow


def slots_from_keep(keep: jax.Array) -> jax.Array:
  """bool [B, K, T] -> int32 slots [B, K, T], original order, -1 where dropped."""
  rank = jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1
  return jnp.where(keep, rank, EMPTY)


def regions(lengths: jax.Array, t: int, window: int) -> tuple[jax.Array, jax.Array]:
  """(prefix [B, T], window [B, T]) masks: the compressible tokens and the observation window."""
  pos = jnp.arange(t)[None]
  start = (lengths - window)[:, None]
  return pos < start, (pos >= start) & (pos < lengths[:, None])


# ------------------------------------------------------------------ segments


def segment_ids(boundary_after: jax.Array) -> jax.Array:
  """bool [B, T] (a segment ends after this token) -> int32 segment id [B, T] from 0."""
  starts = jnp.pad(boundary_after[:, :-1], ((0, 0), (1, 0)))
  return jnp.cumsum(starts, axis=-1, dtype=jnp.int32)


def segment_starts(seg: jax.Array) -> jax.Array:
  """[B, T] segment ids (non-decreasing) -> [B, T] index of the first token of each token's segment."""
  t = seg.shape[1]
  idx = jnp.broadcast_to(jnp.arange(t), seg.shape)
  start = jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)), constant_values=True)
  return jax.lax.cummax(jnp.where(start, idx, 0), axis=1)


def per_segment_sum(x: jax.Array, seg: jax.Array) -> jax.Array:
  """Sums [B, K, T] (or [B, T]) over each segment id < T: -> [B, K, T_seg] (or [B, T_seg]).

  Segment ids index the result's last axis (T_seg = T slots, unused ones 0).
  """
  squeeze = x.ndim == 2
  if squeeze:
    x = x[:, None]
  b, kh, t = x.shape
  flat = (jnp.arange(b)[:, None] * t + seg).reshape(-1)
  out = jax.ops.segment_sum(x.transpose(0, 2, 1).reshape(b * t, kh), flat, num_segments=b * t)
  out = out.reshape(b, t, kh).transpose(0, 2, 1)
  return out[:, 0] if squeeze else out


def gather_segments(x: jax.Array, seg: jax.Array) -> jax.Array:
  """Per-segment values [B, K, T_seg] (or [B, T_seg]) back to tokens: [B, K, T] (or [B, T])."""
  if x.ndim == 2:
    return jnp.take_along_axis(x, seg, -1)
  return jnp.take_along_axis(x, jnp.broadcast_to(seg[:, None], x.shape[:2] + seg.shape[1:]), -1)


def segment_mean(scores: jax.Array, seg: jax.Array, valid: jax.Array) -> jax.Array:
  """Mean score of each token's segment, broadcast back to tokens.

  Args:
    scores: [B, K, T]; seg: [B, T] segment ids < T; valid: [B, T] tokens that count.

  Returns:
    [B, K, T] float32; tokens in segments without valid tokens get -inf.
  """
  sums = per_segment_sum(jnp.where(valid[:, None], scores, 0.0), seg)  # [B, K, T_seg]
  counts = per_segment_sum(valid.astype(jnp.float32), seg)[:, None]  # [B, 1, T_seg]
  mean = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), -jnp.inf)
  return gather_segments(mean, seg)


# ------------------------------------------------------------------ budgets


def keep_whole(scores: jax.Array, sizes: jax.Array, room) -> jax.Array:
  """Whole units (sentences, blocks) in order of score while they fit ``room``.

  The best units are taken until the next one would overflow ``room``: the
  longest run of the score order whose sizes add up to at most ``room``.

  Args:
    scores: [B, K, U]; -inf (or NaN) marks units that cannot be chosen.
    sizes: [B, U] (or [B, K, U]) tokens per unit.
    room: entries the units may take, broadcastable to [B, K, 1].

  Returns:
    bool [B, K, U]: the units kept.
  """
  b, kh, _ = scores.shape
  scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
  order = jnp.argsort(-scores, axis=-1)  # ties: the earlier unit first
  sizes = jnp.broadcast_to(sizes[:, None] if sizes.ndim == 2 else sizes, order.shape)
  sorted_sizes = jnp.take_along_axis(sizes, order, -1)
  usable = jnp.take_along_axis(scores, order, -1) > -jnp.inf
  fits_sorted = usable & (jnp.cumsum(jnp.where(usable, sorted_sizes, 0), -1) <= room)
  return jnp.zeros(order.shape, bool).at[
      jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], order].set(fits_sorted)


def fill_to_budget(chosen: jax.Array, scores: jax.Array, valid: jax.Array, budget,
                   max_budget: int) -> jax.Array:
  """Tops a keep mask up with the best unchosen valid tokens so each head keeps ``budget``.

  Args:
    chosen: bool [B, K, T], normally at most ``budget`` per head (beyond it the
      lowest-scoring chosen tokens are dropped: give must-keep tokens +inf).
    scores: [B, K, T] ranking (higher first); a NaN score ranks below every
      number but may still fill the budget.
    valid: bool [B, T] (or [B, K, T]) tokens that may be kept.
    budget: kept entries per head <= max_budget (as ``keep_top``'s).

  Returns:
    bool [B, K, T]: ``budget`` per head, or every valid token when fewer exist.
  """
  valid = jnp.broadcast_to(valid if valid.ndim == 3 else valid[:, None], scores.shape)
  # Should rounding ever leave more than the budget chosen, the lowest-scoring go.
  ranked = jnp.where(chosen, jnp.where(jnp.isnan(scores), jnp.finfo(jnp.float32).min, scores),
                     -jnp.inf)
  chosen = chosen & keep_top(ranked, budget, max_budget)
  rest = jnp.where(chosen | ~valid, -jnp.inf, scores)
  rest = jnp.where(jnp.isnan(rest), jnp.finfo(jnp.float32).min, rest)
  need = _per_head(budget) - chosen.sum(-1, keepdims=True)
  return chosen | keep_top(rest, need, max_budget)


# ------------------------------------------------------------------ decode


def slot_view(cache, pool: jax.Array) -> jax.Array:
  """A per-slot pool ([P, S_page]: positions, scores) seen per head: [B, L, K, S]."""
  b, l, k, _ = cache.page_table.shape
  return pool[jnp.maximum(cache.page_table, 0)].reshape(b, l, k, -1)


def filled_slots(cache) -> jax.Array:
  """bool [B, L, K, S]: the slots holding an entry."""
  return jnp.arange(cache.max_slots) < cache.lengths[..., None]
