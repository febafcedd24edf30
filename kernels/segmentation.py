"""Segmentation stages: cut a prompt into segments or blocks, sequentially per sequence.

Two stages, each a Pallas kernel beside a float32 jnp reference with the same
contract:

  segment_ids       delimiter cuts -> segment id per token, with a minimum and a
                    maximum segment length (SABlock's semantic segments).
  dynamic_split     DynSplit-KV's walk: from a start s the block ends at the
                    candidate boundary e in [s + C - D, s + C + D] with the
                    highest boundary weight
                        w(e) = mean(d[s:e]) - alpha * mean(d[e:s + C + D])
                    (cut where attention density drops), or at s + C when no
                    candidate lies in the window. Blocks come out in a fixed
                    format: starts and sizes [B, NB] (the uniform mapping).

Both are a scan whose next step depends on the previous cut, so each grid
program (one per sequence, grid (B,)) walks its row with scalar state; the
work is O(T) steps for segment ids and O(T / (C - D)) blocks for the split,
small beside prefill attention.

Two forms of each kernel; ``platform.lowering(interpret)`` picks one:

  GPU (Triton)  a scalar walk: a scalar load or store is a pointer offset, so
                the program reads and writes its row one element at a time.
                Triton's blocks must have power-of-two shapes, so the wrapper
                pads T, T + 1 (the prefix sums) and NB to powers of two and
                slices the results.
  TPU (Mosaic)  vector loads and stores move whole (8, 128) tiles; one element
                at a dynamic lane offset can be neither read nor written. Rows
                are laid out as tiles [T' / 1024, 8, 128] (token t at
                [t // 1024, t % 1024 // 128, t % 128]) and indexed dynamically
                on the leading dim only. An element comes out of its tile by a
                masked reduction to a scalar; segment ids build each output
                tile in registers (where(iota == i, id, tile)) and store it
                once. The split evaluates a block's 2D + 1 candidate ends
                together, as vectors on the one or two tiles that hold them:
                a few reductions per block instead of several per candidate.
                SMEM (scalar memory) would take single elements, but it holds
                1 MiB per core on v4 and later (16 KiB on v2/v3), and the
                pipeline double-buffers each block: a 32K-token row in and out
                takes 512 KiB of it, a 128K-token prompt (Llama-3.2's context)
                2 MiB. VMEM holds 16-128 MiB, so the tiles scale with T.

Shapes: B batch, T tokens (padded), NB = T // (C - D) + 1 blocks at most.
Right padding: tokens at or after lengths[b] belong to no real segment;
lengths[b] <= T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.kernels import platform

# Weight of a boundary that is not a candidate: below any finite weight.
_NOT_CANDIDATE = -jnp.inf
# A TPU tile: (sublanes, lanes) of 32-bit elements, and the elements it holds.
_SUBLANES, _LANES = 8, 128
_TILE = _SUBLANES * _LANES


def max_blocks(num_tokens: int, chunk: int, delta: int) -> int:
  """NB: blocks a walk over ``num_tokens`` can produce (every block but the last >= C - D)."""
  return num_tokens // (chunk - delta) + 1


# ------------------------------------------------------------------ references


def segment_ids_reference(cut_after: jax.Array, lengths: jax.Array, *, max_segment: int,
                          min_segment: int) -> jax.Array:
  """Segment id of every token [B, T] int32, counting from 0 per sequence.

  A segment ends after token t when t is a delimiter (cut_after) and the
  segment already holds >= min_segment tokens, or when it reaches max_segment
  tokens, or at the last valid token. A too-short piece thus merges into the
  segment after it. Padding tokens (t >= lengths[b]) all get the id after the
  last real segment.

  Args:
    cut_after: [B, T] bool, a delimiter ends a clause or sentence after this token.
    lengths: [B] int32 valid tokens per sequence.
  """
  t = cut_after.shape[1]

  def one(cuts, length):
    def step(carry, x):
      seg, run = carry
      cut, i = x
      run = run + 1
      valid = i < length
      end = valid & (((cut != 0) & (run >= min_segment)) | (run >= max_segment)
                     | (i == length - 1))
      new = (jnp.where(end, seg + 1, seg), jnp.where(end, 0, run))
      return new, seg

    _, seg = jax.lax.scan(step, (jnp.int32(0), jnp.int32(0)),
                          (cuts, jnp.arange(t, dtype=jnp.int32)))
    return seg

  return jax.vmap(one)(cut_after, lengths.astype(jnp.int32))


def boundary_weights_reference(prefix: jax.Array, start, *, chunk: int, delta: int,
                               alpha: float) -> jax.Array:
  """w(e) for the 2D + 1 ends e = s + C - D + i of a block starting at ``start``.

  Args:
    prefix: [T + 1] float32 prefix sums of the density (prefix[0] = 0).
    start: the block start s (may be traced).

  Returns:
    [2D + 1] float32: mean density on [s, e) minus alpha times the mean on
    [e, s + C + D) (0 when that range is empty). Ends past T read the clamped
    prefix; callers mask them.
  """
  n = prefix.shape[0]
  hi = start + chunk + delta
  ends = start + chunk - delta + jnp.arange(2 * delta + 1)
  at = lambda i: prefix[jnp.clip(i, 0, n - 1)]
  return _boundary_weight(at(start), at(ends), at(hi), start, ends, hi, alpha)


def _boundary_weight(pre_s, pre_e, pre_hi, s, e, hi, alpha):
  """w(e) from the prefix sums at s, e and hi = s + C + D (every form computes it so)."""
  left = (pre_e - pre_s) / (e - s).astype(jnp.float32)
  right_len = (hi - e).astype(jnp.float32)
  right = jnp.where(right_len > 0, (pre_hi - pre_e) / jnp.maximum(right_len, 1.0), 0.0)
  return left - alpha * right


def dynamic_split_reference(density: jax.Array, candidate: jax.Array, lengths: jax.Array, *,
                            chunk: int, delta: int, alpha: float):
  """DynSplit-KV's importance-aware segmentation of [0, lengths[b]).

  Args:
    density: [B, T] float32 attention each token receives (its importance).
    candidate: [B, T] bool, a block may end after this token (a delimiter).
    lengths: [B] int32 tokens to segment per sequence.

  Returns:
    (starts [B, NB] int32, sizes [B, NB] int32): block j covers
    [starts, starts + sizes); unused blocks have size 0 and start at the length.
    Every block but the last has a size in [C - D, C + D]; once at most C + D
    tokens remain they form the last block.
  """
  b, t = density.shape
  nb = max_blocks(t, chunk, delta)
  prefix = jnp.pad(jnp.cumsum(density.astype(jnp.float32), axis=1), ((0, 0), (1, 0)))

  def one(pre, cand, length):
    def cond(state):
      s, _, _, _ = state
      return s < length

    def body(state):
      s, j, starts, sizes = state
      ends = s + chunk - delta + jnp.arange(2 * delta + 1)
      ok = cand[jnp.clip(ends - 1, 0, t - 1)] & (ends <= length)
      w = jnp.where(ok, boundary_weights_reference(pre, s, chunk=chunk, delta=delta,
                                                   alpha=alpha), _NOT_CANDIDATE)
      best = ends[jnp.argmax(w)]
      e = jnp.where(jnp.any(ok), best, s + chunk)
      e = jnp.where(length - s <= chunk + delta, length, e)
      return e, j + 1, starts.at[j].set(s), sizes.at[j].set(e - s)

    init = (jnp.int32(0), jnp.int32(0), jnp.full((nb,), length, jnp.int32),
            jnp.zeros((nb,), jnp.int32))
    _, _, starts, sizes = jax.lax.while_loop(cond, body, init)
    return starts, sizes

  return jax.vmap(one)(prefix, candidate, lengths.astype(jnp.int32))


# ------------------------------------------------------------------ GPU kernels


def segment_ids_kernel(lengths_ref, cut_ref, seg_ref, *, num_tokens: int, max_segment: int,
                       min_segment: int):
  """GPU form, grid (B,): walks one sequence's tokens.

  Refs:
    lengths_ref: [1] int32; cut_ref: [T'] int32 (1 = delimiter); seg_ref: [T'] int32,
    T' >= T = ``num_tokens`` (the padding is not walked).
  """
  length = lengths_ref[0]

  def step(i, carry):
    seg, run = carry
    seg_ref[i] = seg
    run = run + 1
    end = (i < length) & (((cut_ref[i] != 0) & (run >= min_segment)) | (run >= max_segment)
                          | (i == length - 1))
    return jnp.where(end, seg + 1, seg), jnp.where(end, 0, run)

  jax.lax.fori_loop(0, num_tokens, step, (jnp.int32(0), jnp.int32(0)))


def _isnan(x):
  """x is NaN. Not ``x != x``: Mosaic lowers != on floats as an ordered compare (false
  for NaN)."""
  return ~(x == x)  # pylint: disable=comparison-with-itself


def _better(w, ok, best):
  """Whether candidate weight ``w`` replaces ``best``: the first maximum wins, and a NaN
  weight counts as the maximum (as in jnp.argmax)."""
  return ok & ~_isnan(best) & ((w > best) | _isnan(w))


def dynamic_split_kernel(lengths_ref, prefix_ref, cand_ref, starts_ref, sizes_ref, *,
                         num_tokens: int, num_blocks: int, chunk: int, delta: int,
                         alpha: float):
  """GPU form, grid (B,): the boundary walk of one sequence.

  Refs:
    lengths_ref: [1] int32; prefix_ref: [T1'] float32 prefix sums of the density
    (T1' >= T + 1); cand_ref: [T'] int32 (1 = a block may end after this token);
    starts_ref, sizes_ref: [NB'] int32 (NB' >= NB = ``num_blocks``).
  """
  t, nb = num_tokens, num_blocks
  length = lengths_ref[0]
  starts_ref[...] = jnp.full(starts_ref.shape, length, jnp.int32)
  sizes_ref[...] = jnp.zeros(sizes_ref.shape, jnp.int32)
  pre = lambda i: prefix_ref[jnp.clip(i, 0, t)]

  def weight(s, e):
    hi = s + chunk + delta
    return _boundary_weight(pre(s), pre(e), pre(hi), s, e, hi, alpha)

  def cond(state):
    s, j = state
    return (s < length) & (j < nb)

  def body(state):
    s, j = state

    def visit(i, best):  # best = (weight, end)
      e = s + chunk - delta + i
      ok = (cand_ref[jnp.clip(e - 1, 0, t - 1)] != 0) & (e <= length)
      w = weight(s, e)
      better = _better(w, ok, best[0])
      return jnp.where(better, w, best[0]), jnp.where(better, e, best[1])

    _, best_end = jax.lax.fori_loop(0, 2 * delta + 1, visit,
                                    (jnp.float32(_NOT_CANDIDATE), jnp.int32(-1)))
    e = jnp.where(best_end >= 0, best_end, s + chunk)
    e = jnp.where(length - s <= chunk + delta, length, e)
    starts_ref[j] = s
    sizes_ref[j] = e - s
    return e, j + 1

  jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))


# ------------------------------------------------------------------ TPU kernels


def _tile_offsets():
  """[8, 128] int32: each element's offset within its tile."""
  shape = (_SUBLANES, _LANES)
  return (jax.lax.broadcasted_iota(jnp.int32, shape, 0) * _LANES
          + jax.lax.broadcasted_iota(jnp.int32, shape, 1))


def _pick(tile, at):
  """The element of ``tile`` [8, 128] where ``at`` holds (one element): a scalar."""
  low = -jnp.inf if jnp.issubdtype(tile.dtype, jnp.floating) else jnp.iinfo(tile.dtype).min
  return jnp.max(jnp.where(at, tile, low))


def segment_ids_tpu_kernel(lengths_ref, cut_ref, seg_ref, *, max_segment: int,
                           min_segment: int):
  """TPU form, grid (B,): walks one sequence tile by tile.

  Refs:
    lengths_ref: [B] int32 (SMEM); cut_ref, seg_ref: [T' / 1024, 8, 128] int32.
  """
  length = lengths_ref[pl.program_id(0)]
  offsets = _tile_offsets()

  def tile(k, carry):
    seg, run = carry
    cuts = cut_ref[k]
    base = k * _TILE
    valid = jnp.clip(length - base, 0, _TILE)

    def step(i, carry):  # only valid tokens: i < valid
      seg, run, ids = carry
      at = offsets == i
      ids = jnp.where(at, seg, ids)
      run = run + 1
      end = (((_pick(cuts, at) != 0) & (run >= min_segment)) | (run >= max_segment)
             | (base + i == length - 1))
      return jnp.where(end, seg + 1, seg), jnp.where(end, 0, run), ids

    seg, run, ids = jax.lax.fori_loop(0, valid, step, (seg, run, jnp.zeros_like(cuts)))
    # Padding tokens take the id after the last segment.
    seg_ref[k] = jnp.where(offsets < valid, ids, seg)
    return seg, run

  jax.lax.fori_loop(0, seg_ref.shape[0], tile, (jnp.int32(0), jnp.int32(0)))


def dynamic_split_tpu_kernel(lengths_ref, prefix_ref, cand_ref, starts_ref, sizes_ref, *,
                             num_tokens: int, num_blocks: int, chunk: int, delta: int,
                             alpha: float):
  """TPU form, grid (B,): the boundary walk of one sequence, a block's candidates at once.

  Refs:
    lengths_ref: [B] int32 (SMEM); prefix_ref: [T1 / 1024, 8, 128] float32,
    entry e = the density summed before token e (padded with the total);
    cand_ref: [T1 / 1024, 8, 128] int32, entry e = 1 when a block may end at e,
    i.e. after token e - 1; starts_ref, sizes_ref: [NB' / 1024, 8, 128] int32.
  """
  t, nb = num_tokens, num_blocks
  length = lengths_ref[pl.program_id(0)]
  offsets = _tile_offsets()
  starts_ref[...] = jnp.full(starts_ref.shape, length, jnp.int32)
  sizes_ref[...] = jnp.zeros(sizes_ref.shape, jnp.int32)
  last_tile = prefix_ref.shape[0] - 1
  # Tiles that 2D + 1 consecutive ends can touch.
  span = 2 * delta // _TILE + 2

  # Indices here are >= 0, so lax.div and lax.rem: floor division would add sign
  # fix-ups that Mosaic lowers through the chip's generation (unknown when lowering
  # without one).
  def pre(i):
    i = jnp.clip(i, 0, t)
    return _pick(prefix_ref[jax.lax.div(i, _TILE)], offsets == jax.lax.rem(i, _TILE))

  def cond(state):
    s, j = state
    return (s < length) & (j < nb)

  def body(state):
    s, j = state
    lo, hi = s + chunk - delta, s + chunk + delta
    last = jnp.minimum(hi, length)
    pre_s, pre_hi = pre(s), pre(hi)
    tiles = []
    for m in range(span):  # a clamped repeat of the last tile changes no max or min
      k = jnp.minimum(jax.lax.div(lo, _TILE) + m, last_tile)
      e = k * _TILE + offsets
      pre_e = prefix_ref[k]
      ok = (e >= lo) & (e <= last) & (cand_ref[k] != 0)
      w = _boundary_weight(pre_s, pre_e, pre_hi, s, e, hi, alpha)
      tiles.append((e, ok, jnp.where(ok, w, _NOT_CANDIDATE)))
    # The first end of maximum weight; a NaN weight counts as the maximum (jnp.argmax).
    best = jnp.max(functools.reduce(jnp.maximum, [w for _, _, w in tiles]), keepdims=True)
    hits = [jnp.where(ok & ((w == best) | _isnan(w)), e, jnp.iinfo(jnp.int32).max)
            for e, ok, w in tiles]
    first = jnp.min(functools.reduce(jnp.minimum, hits))
    e = jnp.where(first <= last, first, s + chunk)
    e = jnp.where(length - s <= chunk + delta, length, e)
    at, q = offsets == jax.lax.rem(j, _TILE), jax.lax.div(j, _TILE)
    starts_ref[q] = jnp.where(at, s, starts_ref[q])
    sizes_ref[q] = jnp.where(at, e - s, sizes_ref[q])
    return e, j + 1

  jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))


# ------------------------------------------------------------------ wrappers


def _check(name, x, rank, kinds, shape=None):
  if x.ndim != rank or (shape is not None and tuple(x.shape) != tuple(shape)):
    want = f"rank {rank}" if shape is None else f"shape {tuple(shape)}"
    raise ValueError(f"{name} must have {want}, got shape {x.shape}")
  if not any(jnp.issubdtype(x.dtype, k) for k in kinds):
    raise ValueError(f"{name} must have a dtype in {[k.__name__ for k in kinds]}, got {x.dtype}")


def _check_segment_args(cut_after, lengths, max_segment, min_segment):
  _check("cut_after", cut_after, 2, (jnp.bool_, jnp.integer))
  _check("lengths", lengths, 1, (jnp.integer,), (cut_after.shape[0],))
  for name, value in (("max_segment", max_segment), ("min_segment", min_segment)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  if min_segment > max_segment:
    raise ValueError(f"min_segment {min_segment} exceeds max_segment {max_segment}")


def _check_split_args(density, candidate, lengths, chunk, delta, alpha):
  _check("density", density, 2, (jnp.floating,))
  _check("candidate", candidate, 2, (jnp.bool_, jnp.integer), density.shape)
  _check("lengths", lengths, 1, (jnp.integer,), (density.shape[0],))
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
    raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
  if not isinstance(delta, int) or isinstance(delta, bool) or not 0 <= delta < chunk:
    raise ValueError(f"delta must be an int in [0, chunk={chunk}), got {delta!r}")
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
    raise ValueError(f"alpha must be a finite number, got {alpha!r}")


def _pad_to(x, size, **pad):
  """Pads the last axis of [B, L] to ``size``."""
  return jnp.pad(x, ((0, 0), (0, size - x.shape[1])), **pad)


def _to_tiles(x, **pad):
  """[B, L] -> [B, L' / 1024, 8, 128], the end padded to whole tiles."""
  nt = pl.cdiv(max(x.shape[1], 1), _TILE)
  return _pad_to(x, nt * _TILE, **pad).reshape(x.shape[0], nt, _SUBLANES, _LANES)


def _from_tiles(x, size):
  """[B, L' / 1024, 8, 128] -> [B, size]."""
  return x.reshape(x.shape[0], -1)[:, :size]


def _row_spec(shape):
  """One sequence's row per program: a [B, *shape] array -> block [*shape]."""
  return pl.BlockSpec((None, *shape), lambda i: (i,) + (0,) * len(shape))


def _call(kernel, form, args, out_shapes, interpret):
  """Grid (B,): lengths (SMEM on TPU), then per-sequence rows in and out."""
  lengths, rows = args[0], args[1:]
  if form == platform.TPU:
    len_spec = pl.BlockSpec(memory_space=platform.tpu().SMEM)
  else:
    len_spec = pl.BlockSpec((1,), lambda i: (i,))
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(s, jnp.int32) for s in out_shapes],
      grid=(lengths.shape[0],),
      in_specs=[len_spec] + [_row_spec(x.shape[1:]) for x in rows],
      out_specs=[_row_spec(s[1:]) for s in out_shapes],
      compiler_params=platform.compiler_params(form, 1),
      interpret=interpret,
  )(lengths, *rows)


@functools.partial(jax.jit, static_argnames=("max_segment", "min_segment", "interpret", "target"))
def segment_ids(cut_after: jax.Array, lengths: jax.Array, *, max_segment: int, min_segment: int,
                interpret: bool = False, target: str | None = None) -> jax.Array:
  """Pallas kernel of ``segment_ids_reference`` (same arguments and result).

  interpret: run in Pallas' interpreter (the GPU form); a ``pltpu.InterpretParams``
    (or ``pltpu.force_tpu_interpret_mode()``) runs the TPU form.
  target: the platform whose compiled form to lower to (None: the default device's).
  """
  _check_segment_args(cut_after, lengths, max_segment, min_segment)
  b, t = cut_after.shape
  form = platform.lowering(interpret, target)
  lengths, cut = lengths.astype(jnp.int32), cut_after.astype(jnp.int32)
  opts = dict(max_segment=max_segment, min_segment=min_segment)
  if form == platform.TPU:
    cut = _to_tiles(cut)
    (seg,) = _call(functools.partial(segment_ids_tpu_kernel, **opts), form, (lengths, cut),
                   [cut.shape], interpret)
    return _from_tiles(seg, t)
  cut = _pad_to(cut, pl.next_power_of_2(t))
  (seg,) = _call(functools.partial(segment_ids_kernel, num_tokens=t, **opts), form,
                 (lengths, cut), [cut.shape], interpret)
  return seg[:, :t]


@functools.partial(jax.jit, static_argnames=("chunk", "delta", "alpha", "interpret", "target"))
def dynamic_split(density: jax.Array, candidate: jax.Array, lengths: jax.Array, *, chunk: int,
                  delta: int, alpha: float, interpret: bool = False,
                  target: str | None = None):
  """Pallas kernel of ``dynamic_split_reference`` (same arguments and result).

  The prefix sums are an XLA cumsum in the wrapper; the kernel does the walk.
  interpret, target: as for ``segment_ids``.
  """
  _check_split_args(density, candidate, lengths, chunk, delta, alpha)
  b, t = density.shape
  nb = max_blocks(t, chunk, delta)
  form = platform.lowering(interpret, target)
  lengths, cand = lengths.astype(jnp.int32), candidate.astype(jnp.int32)
  prefix = jnp.pad(jnp.cumsum(density.astype(jnp.float32), axis=1), ((0, 0), (1, 0)))
  opts = dict(num_tokens=t, num_blocks=nb, chunk=chunk, delta=delta, alpha=float(alpha))
  # The prefix sums are padded with their total: reads past T see what the reference's
  # clamped reads see.
  if form == platform.TPU:
    # Candidates move one place right, so entry e answers "may a block end at e".
    prefix, cand = _to_tiles(prefix, mode="edge"), _to_tiles(jnp.pad(cand, ((0, 0), (1, 0))))
    out = ((b, pl.cdiv(nb, _TILE), _SUBLANES, _LANES),) * 2
    starts, sizes = _call(functools.partial(dynamic_split_tpu_kernel, **opts), form,
                          (lengths, prefix, cand), out, interpret)
    return _from_tiles(starts, nb), _from_tiles(sizes, nb)
  prefix = _pad_to(prefix, pl.next_power_of_2(t + 1), mode="edge")
  cand = _pad_to(cand, pl.next_power_of_2(t))
  out = ((b, pl.next_power_of_2(nb)),) * 2
  starts, sizes = _call(functools.partial(dynamic_split_kernel, **opts), form,
                        (lengths, prefix, cand), out, interpret)
  return starts[:, :nb], sizes[:, :nb]


def segment_ids_checked(cut_after, lengths, *, max_segment: int, min_segment: int):
  """The reference with the kernel's argument checks (what policies call by default)."""
  _check_segment_args(cut_after, lengths, max_segment, min_segment)
  return segment_ids_reference(cut_after, lengths, max_segment=max_segment,
                               min_segment=min_segment)


def dynamic_split_checked(density, candidate, lengths, *, chunk: int, delta: int, alpha: float):
  """The reference with the kernel's argument checks (what policies call by default)."""
  _check_split_args(density, candidate, lengths, chunk, delta, alpha)
  return dynamic_split_reference(density, candidate, lengths, chunk=chunk, delta=delta,
                                 alpha=alpha)
