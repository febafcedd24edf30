"""Observation-window scoring: how much attention the last W prompt queries give each key.

Layout (the prompt of one layer, right-padded, RoPE applied):
  q        [B, T, N, H]    queries
  k, v     [B, T, K, H]    keys, values (never repeated per query head)
  lengths  [B]             valid tokens per sequence

The window is the last W valid tokens of each sequence. Each window query
attends causally over the prompt (keys at positions <= its own); its softmax
weights on the keys before the window are averaged over the W window queries,
average-pooled along T (optional), then reduced over the G = N // K query heads
of each KV head (mean or max): scores [B, K, T], zero on the window and the
padding. Key (and value) L2 norms [B, K, T] come out of the same pass over the
keys, for norm-based policies.

Two implementations:
  window_scores_reference  float32 jnp, the definition. ``kvjax.policies.scoring``
                           builds SnapKV's scores on it (XLA backend).
  window_scores            Pallas kernels, blockwise over keys (no W x T or
                           T x T array beyond one [R, C] tile, R = G * W rows):
    pass 1, grid (B, K, T / C): per key block, each row's block max and sum
            of exp (split-K, as in flash decoding) and the key/value norms;
            an XLA step combines the blocks into each row's log-sum-exp;
    pass 2, grid (B, K, T / C): per key block, exp(logit - lse) summed over
            the window rows of each query head (one [G, R] x [R, C] matmul),
            then over the group.
    Every program is independent (no scratch, no sequential grid axis), so
    one kernel body serves the TPU and the GPU lowering (``platform``).
    Pooling (a T-axis stencil crossing blocks) and the prefix mask run in a
    small XLA epilogue on [B, K, T]; with group="max" and pooling the group
    max must follow the pooling, so pass 2 then writes per query head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.kernels import platform

# Dtypes the kernel takes for queries, keys and values.
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Keys one compute block spans at most: a multiple of 128 (TPU lanes) on TPU;
# on GPU an [R, C] float32 tile lives in registers, so C stays small (R = G * W
# rows can reach a few hundred). The GPU figure is untuned (no GPU was at hand).
_MAX_BLOCK_KEYS = {platform.TPU: 512, platform.GPU: 64}

GROUP_REDUCTIONS = ("mean", "max")

# ------------------------------------------------------------------ reference


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


def token_norms_reference(x: jax.Array) -> jax.Array:
  """L2 norm of every token's vector per KV head: [B, T, K, H] -> [B, K, T] float32."""
  return jnp.swapaxes(jnp.linalg.norm(x.astype(jnp.float32), axis=-1), 1, 2)


def window_scores_reference(q, k, lengths, *, window: int, pool: int = 1, group: str = "mean",
                            v=None, return_norms: bool = False):
  """Float32 reference of observation-window scoring.

  Args:
    q: [B, T, N, H]; k: [B, T, K, H]; lengths: [B] int32.
    window: W, the last W valid tokens' queries score the keys before them.
    pool: odd average-pooling width along T (1 = none).
    group: "mean" or "max" over the query heads of each KV head (after pooling).
    v: [B, T, K, H] values, for their norms (with ``return_norms``).
    return_norms: also return key norms and value norms (None without v).

  Returns:
    scores [B, K, T] float32: the mean over window queries of the weight each
    key before the window receives, pooled, reduced over the group; zero on
    the window and the padding. With ``return_norms`` a tuple
    (scores, key norms [B, K, T], value norms [B, K, T] or None).
  """
  rows, pos, valid = window_queries(q, lengths, window)
  received = attention_received(rows, pos, valid, k, lengths) / window  # [B, N, T]
  t = k.shape[1]
  key_pos = jnp.arange(t)[None, :]
  prefix = key_pos < (lengths - window)[:, None]  # [B, T]
  received = jnp.where(prefix[:, None, :], received, 0.0)
  scores = reduce_group(avg_pool(received, pool), k.shape[2], group)
  if not return_norms:
    return scores
  return scores, token_norms_reference(k), None if v is None else token_norms_reference(v)


# ------------------------------------------------------------------ block sizes


@dataclasses.dataclass(frozen=True)
class WindowScoringBlockSizes:
  """How many keys one compute block of the kernels spans.

  Attributes:
    block_keys: C, keys per block (the prompt is padded to a multiple). On
      TPU a multiple of 128 unless one block covers the padded prompt; on
      GPU a power of two >= 16.
  """

  block_keys: int

  def __post_init__(self):
    c = self.block_keys
    if isinstance(c, bool) or not isinstance(c, int) or c <= 0 or c % 8:
      raise ValueError(f"block_keys must be a positive multiple of 8, got {c!r}")

  @classmethod
  def get_default(cls, num_tokens: int, form: str = platform.TPU) -> "WindowScoringBlockSizes":
    """The prompt in one block (a power of two >= 16) up to the form's cap, else blocks of
    the cap: on TPU full or a multiple of 128, on GPU a power of two."""
    cap = _MAX_BLOCK_KEYS[form]
    return cls(min(cap, max(platform.MIN_DOT, pl.next_power_of_2(num_tokens))))


# ------------------------------------------------------------------ kernels


def _logits(q, k, scale):
  """[R, H] x [C, H] -> [R, C] float32 (bf16 x bf16 stays on the fast matmul path)."""
  dtype = jnp.promote_types(q.dtype, k.dtype)
  return jax.lax.dot_general(
      q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * scale


def _norms(x):
  """[C, H] -> [1, C] L2 norms along lanes.

  A matmul with ones gives the sums of squares lane-major ([rows, C]) on both
  Mosaic and Triton without a relayout; 16 identical rows satisfy tl.dot, and
  their max is exact.
  """
  sq = jnp.square(x.astype(jnp.float32))
  ones = jnp.ones((platform.MIN_DOT, x.shape[1]), jnp.float32)
  sums = jax.lax.dot_general(ones, sq, (((1,), (1,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  return jnp.sqrt(sums.max(axis=0, keepdims=True))


def _visible(row_pos, c):
  """[R, C] bool: key (block start + column) at or before each row's position.

  Invalid rows carry position -1, so they see nothing; keys past a sequence's
  length are after every window row, so causality alone masks the padding.
  """
  start = pl.program_id(2) * c
  r = row_pos.shape[0]
  key_pos = start + jax.lax.broadcasted_iota(jnp.int32, (r, c), 1)
  return key_pos <= jnp.broadcast_to(row_pos, (r, c))


def window_stats_kernel(*refs, has_queries: bool, has_values: bool, scale: float):
  """Pass 1, grid (B, K, blocks): row statistics of one key block, and norms.

  Refs (in order, present as flagged):
    q_ref [R, H], pos_ref [R, 1] int32  (has_queries)
    k_ref [C, H]; v_ref [C, H]           (has_values)
    m_ref [R, 1], l_ref [R, 1]           (has_queries) block max and sum of exp(logit - max)
    kn_ref [1, C]; vn_ref [1, C]         (has_values)
  """
  refs = list(refs)
  q_ref, pos_ref = (refs.pop(0), refs.pop(0)) if has_queries else (None, None)
  k_ref = refs.pop(0)
  v_ref = refs.pop(0) if has_values else None
  m_ref, l_ref = (refs.pop(0), refs.pop(0)) if has_queries else (None, None)
  kn_ref = refs.pop(0)
  vn_ref = refs.pop(0) if has_values else None
  k = k_ref[...]
  kn_ref[...] = _norms(k)
  if has_values:
    vn_ref[...] = _norms(v_ref[...])
  if has_queries:
    visible = _visible(pos_ref[...], k.shape[0])
    logits = jnp.where(visible, _logits(q_ref[...], k, scale), -jnp.inf)
    m = logits.max(axis=1, keepdims=True)
    # A row that sees nothing here has m = -inf: where(), not exp(-inf - -inf) = NaN.
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    m_ref[...] = m
    l_ref[...] = p.sum(axis=1, keepdims=True)


def window_received_kernel(q_ref, pos_ref, lse_ref, sel_ref, k_ref, out_ref, *, scale: float,
                           reduce: str, num_groups: int):
  """Pass 2, grid (B, K, blocks): attention each key of a block receives.

  Refs:
    q_ref [R, H]; pos_ref [R, 1] int32; lse_ref [R, 1] each row's log-sum-exp;
    sel_ref [G_pad, R] row weights (1 / W on the rows of query head g);
    k_ref [C, H]; out_ref [1, C] (reduce "mean"/"max") or [G_pad, C] ("none").
  """
  k = k_ref[...]
  visible = _visible(pos_ref[...], k.shape[0])
  p = jnp.where(visible, jnp.exp(_logits(q_ref[...], k, scale) - lse_ref[...]), 0.0)
  per_head = jax.lax.dot_general(sel_ref[...], p, (((1,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)  # [G_pad, C]
  # Padding rows of sel are zero, and weights are >= 0: they change neither.
  if reduce == "mean":
    per_head = per_head.sum(axis=0, keepdims=True) * (1.0 / num_groups)
  elif reduce == "max":
    per_head = per_head.max(axis=0, keepdims=True)
  out_ref[...] = per_head


# ------------------------------------------------------------------ public wrapper


def _validate(q, k, lengths, v, window, pool, group, block_sizes) -> None:
  """Raises ValueError, quoting the values, for any input the kernels cannot take."""
  if k.ndim != 4:
    raise ValueError(f"k must have rank 4 [B, T, K, H], got shape {k.shape}")
  if q is not None:
    if q.ndim != 4:
      raise ValueError(f"q must have rank 4 [B, T, N, H], got shape {q.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
      raise ValueError(f"q {q.shape} and k {k.shape} must share B, T and H")
    if q.shape[2] % k.shape[2]:
      raise ValueError(f"query heads N={q.shape[2]} must be a multiple of KV heads "
                       f"K={k.shape[2]}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x is not None and x.dtype not in _DTYPES:
      raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")
  if v is not None and v.shape != k.shape:
    raise ValueError(f"v {v.shape} must have k's shape {k.shape}")
  if lengths is not None:
    if lengths.shape != (k.shape[0],):
      raise ValueError(f"lengths must have shape [B] = ({k.shape[0]},), got {lengths.shape}")
    if lengths.dtype != jnp.int32:
      raise ValueError(f"lengths must be int32, got {lengths.dtype}")
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"window must be a positive int, got {window!r}")
  if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or pool % 2 == 0:
    raise ValueError(f"pool must be an odd positive int, got {pool!r}")
  if group not in GROUP_REDUCTIONS:
    raise ValueError(f"group must be one of {GROUP_REDUCTIONS}, got {group!r}")
  if block_sizes is not None and not isinstance(block_sizes, WindowScoringBlockSizes):
    raise ValueError(f"block_sizes must be a WindowScoringBlockSizes or None, got "
                     f"{block_sizes!r}")


def _layout(x, t_pad):
  """[B, T, K, H] -> [B, K, T_pad, H], zero-padded along T."""
  return jnp.pad(x, ((0, 0), (0, t_pad - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _check_blocks(form, c, t_pad, h, rows, interpret) -> None:
  if form == platform.TPU and c % 128 and c != t_pad:
    raise ValueError(f"the TPU kernel needs block_keys ({c}) to be a multiple of 128 or to "
                     f"cover the padded prompt ({t_pad})")
  if form == platform.GPU and not interpret:
    platform.check_triton(block_keys=c, head_dim=h, rows=rows)


def _norm_pass(q_rows, row_pos, kt, vt, *, c, form, interpret):
  """Runs pass 1. q_rows [B, K, R, H] or None; kt/vt [B, K, T_pad, H].

  Returns (m [B, K, blocks, R] | None, l | None, key norms [B, K, T_pad],
  value norms | None).
  """
  b, kh, t_pad, h = kt.shape
  nb = t_pad // c
  has_q, has_v = q_rows is not None, vt is not None
  key_spec = pl.BlockSpec((None, None, c, h), lambda bi, ki, j: (bi, ki, j, 0))
  norm_spec = pl.BlockSpec((None, None, 1, c), lambda bi, ki, j: (bi, ki, 0, j))
  norm_shape = jax.ShapeDtypeStruct((b, kh, 1, t_pad), jnp.float32)
  in_specs, args, out_specs, out_shape = [], [], [], []
  if has_q:
    r = q_rows.shape[2]
    in_specs += [pl.BlockSpec((None, None, r, h), lambda bi, ki, j: (bi, ki, 0, 0)),
                 pl.BlockSpec((None, r, 1), lambda bi, ki, j: (bi, 0, 0))]
    args += [q_rows, row_pos]
    stat_spec = pl.BlockSpec((None, None, None, r, 1), lambda bi, ki, j: (bi, ki, j, 0, 0))
    out_specs += [stat_spec, stat_spec]
    out_shape += [jax.ShapeDtypeStruct((b, kh, nb, r, 1), jnp.float32)] * 2
  in_specs.append(key_spec)
  args.append(kt)
  if has_v:
    in_specs.append(key_spec)
    args.append(vt)
  out_specs.append(norm_spec)
  out_shape.append(norm_shape)
  if has_v:
    out_specs.append(norm_spec)
    out_shape.append(norm_shape)
  outs = pl.pallas_call(
      functools.partial(window_stats_kernel, has_queries=has_q, has_values=has_v,
                        scale=h ** -0.5),
      out_shape=out_shape, grid=(b, kh, nb), in_specs=in_specs, out_specs=out_specs,
      compiler_params=platform.compiler_params(form, 3), interpret=interpret,
  )(*args)
  outs = list(outs)
  m, l = (outs.pop(0)[..., 0], outs.pop(0)[..., 0]) if has_q else (None, None)
  kn = outs.pop(0)[:, :, 0]
  vn = outs.pop(0)[:, :, 0] if has_v else None
  return m, l, kn, vn


def _combine_lse(m, l):
  """Each row's log-sum-exp from its per-block maxima and sums: [B, K, blocks, R] -> [B, K, R]."""
  top = m.max(axis=2, keepdims=True)
  safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = jnp.sum(l * jnp.exp(m - safe_top), axis=2)  # exp(-inf) = 0 for empty blocks
  return jnp.where(total > 0, safe_top[:, :, 0] + jnp.log(jnp.where(total > 0, total, 1.0)),
                   -jnp.inf)


@functools.partial(jax.jit, static_argnames=("window", "pool", "group", "return_norms",
                                             "block_sizes", "interpret", "target"))
def window_scores(q, k, lengths, *, window: int, pool: int = 1, group: str = "mean", v=None,
                  return_norms: bool = False,
                  block_sizes: WindowScoringBlockSizes | None = None, interpret=False,
                  target: str | None = None):
  """Observation-window scoring as Pallas kernels (same contract as the reference).

  Args:
    q: [B, T, N, H] float32 or bfloat16; k: [B, T, K, H]; lengths: [B] int32.
    window, pool, group, v, return_norms: as in ``window_scores_reference``.
    block_sizes: keys per compute block (default: see ``get_default``).
    interpret: run the kernel bodies in Pallas' interpreter (CPU); a
      ``pltpu.InterpretParams`` selects TPU interpret mode.
    target: the platform whose compiled form to lower to ("gpu", "tpu"; None:
      the default device's); the interpreter runs either form on a CPU.
  """
  _validate(q, k, lengths, v, window, pool, group, block_sizes)
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  form = platform.lowering(interpret, target)
  if block_sizes is None:
    block_sizes = WindowScoringBlockSizes.get_default(t, form)
  c = block_sizes.block_keys
  t_pad = pl.cdiv(t, c) * c
  r = platform.pad_rows(g * window, form)
  reduce = "none" if (group == "max" and pool > 1) else group
  g_out = platform.pad_rows(g, form)
  _check_blocks(form, c, t_pad, h, r, interpret)

  # Window rows head-major: row g * W + w is query head g of window token w.
  rows, pos, valid = window_queries(q, lengths, window)  # [B, W, N, H], [B, W], [B, W]
  q_rows = rows.reshape(b, window, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * window, h)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, r - g * window), (0, 0)))
  row_pos = jnp.broadcast_to(jnp.where(valid, pos, -1)[:, None, :], (b, g, window))
  row_pos = jnp.pad(row_pos.reshape(b, g * window), ((0, 0), (0, r - g * window)),
                    constant_values=-1)[..., None].astype(jnp.int32)  # [B, R, 1]
  kt = _layout(k, t_pad)
  vt = _layout(v, t_pad) if (v is not None and return_norms) else None

  m, l, kn, vn = _norm_pass(q_rows, row_pos, kt, vt if return_norms else None, c=c, form=form,
                            interpret=interpret)
  lse = _combine_lse(m, l)[..., None]  # [B, K, R, 1]
  sel = np.zeros((g_out, r), np.float32)
  for gi in range(g):
    sel[gi, gi * window:(gi + 1) * window] = 1.0 / window
  rows_out = 1 if reduce != "none" else g_out
  received = pl.pallas_call(
      functools.partial(window_received_kernel, scale=h ** -0.5, reduce=reduce, num_groups=g),
      out_shape=jax.ShapeDtypeStruct((b, kh, rows_out, t_pad), jnp.float32),
      grid=(b, kh, t_pad // c),
      in_specs=[pl.BlockSpec((None, None, r, h), lambda bi, ki, j: (bi, ki, 0, 0)),
                pl.BlockSpec((None, r, 1), lambda bi, ki, j: (bi, 0, 0)),
                pl.BlockSpec((None, None, r, 1), lambda bi, ki, j: (bi, ki, 0, 0)),
                pl.BlockSpec((g_out, r), lambda bi, ki, j: (0, 0)),
                pl.BlockSpec((None, None, c, h), lambda bi, ki, j: (bi, ki, j, 0))],
      out_specs=pl.BlockSpec((None, None, rows_out, c), lambda bi, ki, j: (bi, ki, 0, j)),
      compiler_params=platform.compiler_params(form, 3), interpret=interpret,
  )(q_rows, row_pos, lse, jnp.asarray(sel), kt)[..., :t]

  # Epilogue on [B, K, (G,) T]: the prefix mask and the pooling stencil.
  prefix = jnp.arange(t)[None, :] < (lengths - window)[:, None]  # [B, T]
  if reduce == "none":
    scores = jnp.where(prefix[:, None, None], received[:, :, :g], 0.0)
    scores = avg_pool(scores, pool).max(axis=2)
  else:
    scores = avg_pool(jnp.where(prefix[:, None], received[:, :, 0], 0.0), pool)
  if not return_norms:
    return scores
  return scores, kn[..., :t], None if vn is None else vn[..., :t]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "target"))
def token_norms(x, *, block_sizes: WindowScoringBlockSizes | None = None, interpret=False,
                target: str | None = None):
  """L2 norms [B, K, T] of x [B, T, K, H] (pass 1 without queries); see the reference."""
  _validate(None, x, None, None, 1, 1, "mean", block_sizes)
  b, t, kh, h = x.shape
  form = platform.lowering(interpret, target)
  if block_sizes is None:
    block_sizes = WindowScoringBlockSizes.get_default(t, form)
  c = block_sizes.block_keys
  t_pad = pl.cdiv(t, c) * c
  _check_blocks(form, c, t_pad, h, platform.MIN_DOT, interpret)
  _, _, kn, _ = _norm_pass(None, None, _layout(x, t_pad), None, c=c, form=form,
                           interpret=interpret)
  return kn[..., :t]
