"""Stages shared by the block- and segment-based policies (SABlock, DynSplit-KV, PagedEviction).

They sit beside ``scoring`` and ``selection`` and use them; what is here is
what those modules lack: delimiter tables from token text, observation-window
token scores split into (per-head score, density), value/key-norm scores,
water-filling a budget over segments, and topping a keep mask up to exactly
the budget. Dimension letters: B batch, K KV heads, T tokens, S segments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.policies import baselines
from kvjax.policies import scoring
from kvjax.policies import selection

# Text that ends a sentence (baselines.SENTENCE_END: . ! ? newline, CJK 。！？).
SENTENCE_END = baselines.SENTENCE_END
# ... or a clause: ASCII , ; : and CJK ， ； ： 、
CLAUSE_END = SENTENCE_END + (",", ";", ":", "，", "；", "：", "、")
# Code delimiters (DynSplit-KV's candidates also cut code): { } ; ) ]
CODE_DELIMITERS = ("{", "}", ";", ")", "]")


@functools.lru_cache(maxsize=8)
def _ids_containing(tokenizer, chars: tuple[str, ...]) -> tuple[int, ...]:
  ids = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode([i], skip_special_tokens=True)
    if any(c in text for c in chars):
      ids.append(i)
  return tuple(ids)


def delimiter_ids(tokenizer, chars=CLAUSE_END, *, anywhere: bool = False) -> tuple[int, ...]:
  """Ids of the tokens whose decoded text ends with (or, ``anywhere``, contains) one of ``chars``.

  Decoded text, not fixed ids, so the same rule works for any tokenizer
  (byte-level BPE merges punctuation with spaces and newlines into many ids).
  The ``anywhere=False`` case is ``kvjax.policies.delimiter_ids`` (trailing
  spaces ignored) with other characters.
  """
  chars = tuple(chars)
  if anywhere:
    return _ids_containing(tokenizer, chars)
  return baselines.delimiter_ids(tokenizer, chars)


def check_ids(policy, field: str) -> None:
  """Normalises a token-id field to a tuple of ints >= 0 (hashable), or raises ValueError."""
  ids = getattr(policy, field)
  if (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
      or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
    raise ValueError(f"policy {policy.name!r}: {field} must be a sequence of token ids "
                     f"(ints >= 0), got {ids!r}")
  object.__setattr__(policy, field, tuple(ids))


def is_delimiter(tokens: jax.Array, ids: tuple[int, ...]) -> jax.Array:
  """bool [B, T]: the token is one of ``ids``."""
  return jnp.isin(tokens, jnp.asarray(ids, jnp.int32))


def regions(lengths: jax.Array, t: int, window: int):
  """(prefix [B, T], window [B, T]) masks: the compressible tokens and the observation window."""
  pos = jnp.arange(t)[None]
  start = (lengths - window)[:, None]
  return pos < start, (pos >= start) & (pos < lengths[:, None])


def window_scores(q, k, lengths, *, window: int, kernel: int, group: str):
  """Observation-window attention on the compressible tokens.

  Returns (scores [B, K, T], density [B, T]), float32, zero outside the
  prefix: ``scores`` is SnapKV's token score (window-averaged attention, GQA-
  reduced, pooled with ``kernel``); ``density`` is the unpooled attention
  averaged over every query head (one number per token for the whole layer).
  """
  raw = scoring.snapkv_scores(q, k, lengths, window=window, kernel=1, group=group)
  prefix, _ = regions(lengths, k.shape[1], window)
  raw = jnp.where(prefix[:, None], raw, 0.0)
  # Mean and pooling are linear, so pooling the group mean equals SnapKV's
  # pool-then-reduce for group="mean"; for "max" it pools the maximum.
  scores = jnp.where(prefix[:, None], scoring.avg_pool(raw, kernel), 0.0)
  return scores, raw.mean(1)


NORM_VARIANTS = ("v_over_k", "v", "inv_k", "k_plus_v")


def norm_scores(k_norm: jax.Array, v_norm: jax.Array, variant: str) -> jax.Array:
  """PagedEviction's token importance from key and value L2 norms (any shape, float32).

  v_over_k: ||v|| / ||k|| (the paper's, as summaries read it); v: ||v||;
  inv_k: 1 / ||k||; k_plus_v: ||k|| + ||v|| (the authors' prototype variants).
  """
  k_norm = k_norm.astype(jnp.float32)
  v_norm = v_norm.astype(jnp.float32)
  # A zero key would score inf; clamp so one token cannot outrank every other by +inf.
  safe_k = jnp.maximum(k_norm, 1e-6)
  if variant == "v_over_k":
    return v_norm / safe_k
  if variant == "v":
    return v_norm
  if variant == "inv_k":
    return 1.0 / safe_k
  if variant == "k_plus_v":
    return k_norm + v_norm
  raise ValueError(f"norm score variant must be one of {NORM_VARIANTS}, got {variant!r}")


def fill_to_budget(chosen: jax.Array, scores: jax.Array, valid: jax.Array, budget,
                   max_budget: int) -> jax.Array:
  """Tops a keep mask up with the best unchosen valid tokens so each head keeps ``budget``.

  Args:
    chosen: bool [B, K, T], normally at most ``budget`` per head (beyond it the
      lowest-scoring chosen tokens are dropped: give must-keep tokens +inf).
    scores: [B, K, T] ranking (higher first).
    valid: bool [B, T] (or [B, K, T]) tokens that may be kept.
    budget: kept entries per head (int or traced scalar <= max_budget).

  Returns:
    bool [B, K, T]: ``budget`` per head, or every valid token when fewer exist.
  """
  valid = jnp.broadcast_to(valid if valid.ndim == 3 else valid[:, None], scores.shape)
  # Should rounding ever leave more than the budget chosen, the lowest-scoring go.
  ranked = jnp.where(chosen, jnp.where(jnp.isnan(scores), jnp.finfo(jnp.float32).min, scores),
                     -jnp.inf)
  chosen = chosen & selection.keep_top(ranked, budget, max_budget)
  rest = jnp.where(chosen | ~valid, -jnp.inf, scores)
  rest = jnp.where(jnp.isnan(rest), jnp.finfo(jnp.float32).min, rest)
  need = budget - chosen.sum(-1, keepdims=True)
  return chosen | selection.keep_top(rest, need, max_budget)


def water_fill(importance: jax.Array, size: jax.Array, room: jax.Array) -> jax.Array:
  """Splits ``room`` entries over segments in proportion to importance, capped at their sizes.

  Finds the level lam with sum_s min(size_s, lam * importance_s) = room
  (exactly, by sorting segments by size / importance), so no segment gets
  more than it holds and the rest of the room goes to the others.

  Args:
    importance: [..., S] float32 >= 0 (0 for absent segments).
    size: [..., S] segment lengths (0 for absent segments).
    room: [...] entries to hand out.

  Returns:
    [..., S] float32 allocations (sum = min(room, total size)).
  """
  imp = jnp.maximum(jnp.nan_to_num(importance.astype(jnp.float32)), 0.0)
  size = size.astype(jnp.float32)
  room = jnp.minimum(room.astype(jnp.float32), size.sum(-1))
  # A segment with no importance but some size can only be filled last: give
  # every present segment a tiny importance so the level stays finite.
  imp = jnp.where(size > 0, imp + 1e-12, 0.0)
  ratio = jnp.where(size > 0, size / jnp.where(imp > 0, imp, 1.0), jnp.inf)
  order = jnp.argsort(ratio, axis=-1)
  r = jnp.take_along_axis(ratio, order, -1)
  s_sorted = jnp.take_along_axis(size, order, -1)
  i_sorted = jnp.take_along_axis(imp, order, -1)
  capped = jnp.cumsum(s_sorted, -1) - s_sorted  # sizes of the segments before j (capped)
  rest_imp = jnp.flip(jnp.cumsum(jnp.flip(i_sorted, -1), -1), -1)  # importance from j on
  lam = (room[..., None] - capped) / jnp.maximum(rest_imp, 1e-30)
  # The level is the first j whose segment is not capped at that level.
  fits = (lam <= r) & (rest_imp > 0)
  first = jnp.argmax(fits, -1)
  level = jnp.take_along_axis(lam, first[..., None], -1)
  level = jnp.where(jnp.any(fits, -1, keepdims=True), level, jnp.inf)
  return jnp.minimum(size, level * imp)


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
