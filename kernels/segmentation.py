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
program (one per sequence) walks its row with scalar state; the work is O(T)
(O(T * D / C) for the walk) scalar steps, small beside prefill attention.

Shapes: B batch, T tokens (padded), NB = T // (C - D) + 1 blocks at most.
Right padding: tokens at or after lengths[b] belong to no real segment.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Weight of a boundary that is not a candidate: below any finite weight.
_NOT_CANDIDATE = -jnp.inf


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
  left = (at(ends) - at(start)) / (ends - start).astype(jnp.float32)
  right_len = (hi - ends).astype(jnp.float32)
  right = jnp.where(right_len > 0, (at(hi) - at(ends)) / jnp.maximum(right_len, 1.0), 0.0)
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


# ------------------------------------------------------------------ kernels


def segment_ids_kernel(lengths_ref, cut_ref, seg_ref, *, max_segment: int, min_segment: int):
  """Grid (B,): walks one sequence's tokens.

  Refs:
    lengths_ref: [1] int32; cut_ref: [1, T] int32 (1 = delimiter); seg_ref: [1, T] int32.
  """
  t = cut_ref.shape[1]
  length = lengths_ref[0]

  def step(i, carry):
    seg, run = carry
    seg_ref[0, i] = seg
    run = run + 1
    end = (i < length) & (((cut_ref[0, i] != 0) & (run >= min_segment)) | (run >= max_segment)
                          | (i == length - 1))
    return jnp.where(end, seg + 1, seg), jnp.where(end, 0, run)

  jax.lax.fori_loop(0, t, step, (jnp.int32(0), jnp.int32(0)))


def dynamic_split_kernel(lengths_ref, prefix_ref, cand_ref, starts_ref, sizes_ref, *,
                         chunk: int, delta: int, alpha: float):
  """Grid (B,): the boundary walk of one sequence.

  Refs:
    lengths_ref: [1] int32; prefix_ref: [1, T + 1] float32 prefix sums of the
    density; cand_ref: [1, T] int32 (1 = a block may end after this token);
    starts_ref, sizes_ref: [1, NB] int32.
  """
  t = cand_ref.shape[1]
  nb = starts_ref.shape[1]
  length = lengths_ref[0]
  starts_ref[...] = jnp.full(starts_ref.shape, length, jnp.int32)
  sizes_ref[...] = jnp.zeros(sizes_ref.shape, jnp.int32)
  pre = lambda i: prefix_ref[0, jnp.clip(i, 0, t)]

  def weight(s, e):
    hi = s + chunk + delta
    left = (pre(e) - pre(s)) / (e - s).astype(jnp.float32)
    right_len = hi - e
    right = jnp.where(right_len > 0,
                      (pre(hi) - pre(e)) / jnp.maximum(right_len, 1).astype(jnp.float32), 0.0)
    return left - alpha * right

  def cond(state):
    s, j = state
    return (s < length) & (j < nb)

  def body(state):
    s, j = state

    def visit(i, best):  # best = (weight, end), first maximum wins
      e = s + chunk - delta + i
      ok = (cand_ref[0, jnp.clip(e - 1, 0, t - 1)] != 0) & (e <= length)
      w = jnp.where(ok, weight(s, e), _NOT_CANDIDATE)
      better = ok & (w > best[0])
      return jnp.where(better, w, best[0]), jnp.where(better, e, best[1])

    _, best_end = jax.lax.fori_loop(0, 2 * delta + 1, visit,
                                    (jnp.float32(_NOT_CANDIDATE), jnp.int32(-1)))
    e = jnp.where(best_end >= 0, best_end, s + chunk)
    e = jnp.where(length - s <= chunk + delta, length, e)
    starts_ref[0, j] = s
    sizes_ref[0, j] = e - s
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


@functools.partial(jax.jit, static_argnames=("max_segment", "min_segment", "interpret"))
def segment_ids(cut_after: jax.Array, lengths: jax.Array, *, max_segment: int, min_segment: int,
                interpret: bool = False) -> jax.Array:
  """Pallas kernel of ``segment_ids_reference`` (same arguments and result)."""
  _check_segment_args(cut_after, lengths, max_segment, min_segment)
  b, t = cut_after.shape
  row = pl.BlockSpec((1, t), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(segment_ids_kernel, max_segment=max_segment, min_segment=min_segment),
      out_shape=jax.ShapeDtypeStruct((b, t), jnp.int32),
      grid=(b,),
      in_specs=[pl.BlockSpec((1,), lambda i: (i,)), row],
      out_specs=row,
      interpret=interpret,
  )(lengths.astype(jnp.int32), cut_after.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("chunk", "delta", "alpha", "interpret"))
def dynamic_split(density: jax.Array, candidate: jax.Array, lengths: jax.Array, *, chunk: int,
                  delta: int, alpha: float, interpret: bool = False):
  """Pallas kernel of ``dynamic_split_reference`` (same arguments and result).

  The prefix sums are an XLA cumsum in the wrapper; the kernel does the walk.
  """
  _check_split_args(density, candidate, lengths, chunk, delta, alpha)
  b, t = density.shape
  nb = max_blocks(t, chunk, delta)
  prefix = jnp.pad(jnp.cumsum(density.astype(jnp.float32), axis=1), ((0, 0), (1, 0)))
  out = pl.BlockSpec((1, nb), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(dynamic_split_kernel, chunk=chunk, delta=delta, alpha=float(alpha)),
      out_shape=[jax.ShapeDtypeStruct((b, nb), jnp.int32)] * 2,
      grid=(b,),
      in_specs=[pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec((1, t + 1), lambda i: (i, 0)),
                pl.BlockSpec((1, t), lambda i: (i, 0))],
      out_specs=[out, out],
      interpret=interpret,
  )(lengths.astype(jnp.int32), prefix, candidate.astype(jnp.int32))


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
