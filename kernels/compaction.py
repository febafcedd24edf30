"""Compaction: move the kept entries of each head to the front of its pages, free the rest.

Layout (one row r per (sequence[, layer], KV head); callers flatten their
[B, (L,) K] heads into R rows):
  pools       tuple of [P, S_page, ...] arrays moved together (keys, values,
              and per-slot metadata such as original positions and scores)
  page_table  [R, P_max] int32 page ids of each row, -1 = none
  lengths     [R] int32 filled slots of each row
  keep        [R, S_keep] int32 slots each row keeps (-1 = none); order and
              duplicates do not matter, slots outside [0, length) are ignored

After compaction row r holds its n_r kept entries in slots 0 .. n_r - 1, in
their original slot order; its first ceil(n_r / S_page) pages stay, the rest
are returned as freed (and removed from the table). Slots past n_r on the
last kept page take each pool's ``fill`` (None leaves them as they were).

Entry-level compaction moves data; whole-page eviction (``compact_pages``)
moves none: kept pages only move to the front of the page table.

Two implementations of ``compact_slots`` with one contract:
  compact_slots_reference   jnp, out of place (reads the original pools).
  compact_slots             Pallas, in place: the pools are aliased to the
                            outputs (``input_output_aliases``) and donated by
                            the jitted wrapper. One grid program per row;
                            it rewrites its destination pages in increasing
                            order. Sorted distinct kept slots satisfy
                            source slot >= destination slot, so every source a
                            page needs lies in that page or a later one, not
                            yet rewritten: reading a page's sources before
                            writing it is enough. Rows own disjoint pages.
    TPU form: pools stay in HBM (``pl.ANY``); the move indices are
      scalar-prefetched; each kept entry arrives by a DMA into a VMEM page
      buffer, which is DMAed to its destination page.
    GPU form: pools are flattened to [P * S_page, ...] and the kernel
      gathers a page's sources and scatters them, with a barrier between
      (the threads of a program load and store different slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.kernels import platform

_BIG = jnp.iinfo(jnp.int32).max

# ------------------------------------------------------------------ index maps (shared)


def canonical_keep(keep: jax.Array, lengths: jax.Array):
  """Sorted distinct kept slots in [0, length) first, then -1: ([R, S_keep], new lengths [R])."""
  valid = (keep >= 0) & (keep < lengths[:, None])
  x = jnp.sort(jnp.where(valid, keep, _BIG), axis=1)
  dup = jnp.pad(x[:, 1:] == x[:, :-1], ((0, 0), (1, 0))) & (x != _BIG)
  x = jnp.sort(jnp.where(dup, _BIG, x), axis=1)
  kept = x != _BIG
  return jnp.where(kept, x, -1), kept.sum(axis=1, dtype=jnp.int32)


def source_slots(keep: jax.Array, lengths: jax.Array, slots: int):
  """The slot each of a row's ``slots`` destination slots reads from.

  Returns (src_slot [R, slots] int32: the i-th kept slot for i below the new
  length, slot i itself past it; new lengths [R]).
  """
  keep, new_len = canonical_keep(keep, lengths)
  s_keep = keep.shape[1]
  # new_len <= length <= slots, so the kept prefix always fits in `slots`.
  keep = keep[:, :slots] if s_keep >= slots else jnp.pad(keep, ((0, 0), (0, slots - s_keep)),
                                                         constant_values=-1)
  dst_slot = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), keep.shape)
  return jnp.where(dst_slot < new_len[:, None], keep, dst_slot), new_len


def plan_moves(page_table: jax.Array, lengths: jax.Array, keep: jax.Array, page_size: int):
  """Where every destination slot reads from.

  Returns:
    src_page, src_off: [R, P_max * S_page] int32, the source of destination
      slot i (slot i itself past the new length);
    dst_page: [R, P_max] int32, the pages kept (in place), -1 past them;
    new_lengths: [R] int32;
    freed: [R, P_max] int32 page ids given up, -1 elsewhere.
  """
  p_max = page_table.shape[1]
  src_slot, new_len = source_slots(keep, lengths, p_max * page_size)
  src_page = jnp.take_along_axis(page_table, src_slot // page_size, axis=1)
  n_pages = (new_len + page_size - 1) // page_size
  stays = jnp.arange(p_max)[None, :] < n_pages[:, None]
  dst_page = jnp.where(stays, page_table, -1)
  freed = jnp.where(stays, -1, page_table)
  return jnp.maximum(src_page, 0), src_slot % page_size, dst_page, new_len, freed


def _fill_mask(new_len, j, shape, page_size):
  """bool of ``shape`` (axis 0 = slots of destination page j): slot holds a kept entry."""
  return j * page_size + jax.lax.broadcasted_iota(jnp.int32, shape, 0) < new_len


# ------------------------------------------------------------------ reference


def compact_slots_reference(pools, page_table, lengths, keep, *, fills):
  """Out-of-place reference; returns (pools, page_table, lengths, freed [R, P_max])."""
  _validate(pools, page_table, lengths, keep, fills)
  page_size = pools[0].shape[1]
  src_page, src_off, dst_page, new_len, freed = plan_moves(page_table, lengths, keep, page_size)
  r, p_max = page_table.shape
  slot = jnp.arange(p_max * page_size)
  page = jnp.repeat(dst_page, page_size, axis=1)  # [R, S]
  page = jnp.where(page >= 0, page, pools[0].shape[0])  # past the kept pages: dropped
  off = jnp.broadcast_to(slot % page_size, page.shape)
  live = slot[None, :] < new_len[:, None]  # [R, S]
  out = []
  for pool, fill in zip(pools, fills):
    moved = pool[src_page, src_off]  # [R, S, ...]
    if fill is not None:
      mask = live.reshape(live.shape + (1,) * (pool.ndim - 2))
      moved = jnp.where(mask, moved, jnp.asarray(fill, pool.dtype))
    out.append(pool.at[page, off].set(moved, mode="drop"))
  return tuple(out), dst_page, new_len, freed


# ------------------------------------------------------------------ kernels


def compact_dma_kernel(src_page_ref, src_off_ref, dst_page_ref, len_ref, *refs, num_pools: int,
                       page_size: int, pages_max: int, fills):
  """TPU form, grid (R,). Scalar-prefetched (SMEM): src_page/src_off [R * P_max * S_page],
  dst_page [R * P_max], new lengths [R]. refs: the pools (aliased inputs, unused),
  the pools (outputs, HBM), one VMEM page buffer per pool."""
  pltpu = platform.tpu()
  outs = refs[num_pools:2 * num_pools]
  bufs = refs[2 * num_pools:]
  row = pl.program_id(0)
  new_len = len_ref[row]
  n_pages = jax.lax.div(new_len + page_size - 1, page_size)

  def page(j, carry):
    base = (row * pages_max + j) * page_size

    def slot(i, carry):
      sp, so = src_page_ref[base + i], src_off_ref[base + i]
      for o, buf in zip(outs, bufs):
        pltpu.sync_copy(o.at[sp, pl.ds(so, 1)], buf.at[pl.ds(i, 1)])
      return carry

    jax.lax.fori_loop(0, page_size, slot, 0)
    dst = dst_page_ref[row * pages_max + j]
    for o, buf, fill in zip(outs, bufs, fills):
      if fill is not None:
        buf[...] = jnp.where(_fill_mask(new_len, j, buf.shape, page_size), buf[...],
                             jnp.asarray(fill, buf.dtype))
      pltpu.sync_copy(buf, o.at[dst])
    return carry

  jax.lax.fori_loop(0, n_pages, page, 0)


def compact_gather_kernel(src_ref, dst_ref, len_ref, *refs, num_pools: int, page_size: int,
                          fills, barrier: bool):
  """GPU form, grid (R,). src_ref [P_pad * S_page] flat source slot per destination slot;
  dst_ref [P_pad] destination pages; len_ref [1]; refs: the flattened pools
  [P * S_page, ...] (aliased inputs, unused), then the same as outputs."""
  pltriton = platform.triton()
  outs = refs[num_pools:]
  new_len = len_ref[0]
  n_pages = jax.lax.div(new_len + page_size - 1, page_size)

  def page(j, carry):
    src = src_ref[pl.ds(j * page_size, page_size)]
    dst = dst_ref[j] * page_size + jnp.arange(page_size)
    moved = [o[src] for o in outs]
    if barrier:  # every thread has loaded before any overwrites a source
      pltriton.debug_barrier()
    for o, rows, fill in zip(outs, moved, fills):
      if fill is not None:
        rows = jnp.where(_fill_mask(new_len, j, rows.shape, page_size), rows,
                         jnp.asarray(fill, rows.dtype))
      o[dst] = rows
    if barrier:  # stores of page j land before page j + 1 reads
      pltriton.debug_barrier()
    return carry

  jax.lax.fori_loop(0, n_pages, page, 0)


# ------------------------------------------------------------------ public wrappers


def _validate(pools, page_table, lengths, keep, fills) -> None:
  """Raises ValueError, quoting the values, for any input the kernels cannot take."""
  if not isinstance(pools, (tuple, list)) or not pools:
    raise ValueError(f"pools must be a non-empty tuple of arrays, got {type(pools).__name__}")
  if not isinstance(fills, tuple) or len(fills) != len(pools):
    raise ValueError(f"fills must be a tuple with one entry (None or a number) per pool: "
                     f"{len(pools)} pools, got {fills!r}")
  p, s = pools[0].shape[:2] if pools[0].ndim >= 2 else (None, None)
  for i, pool in enumerate(pools):
    if pool.ndim not in (2, 3) or pool.shape[:2] != (p, s):
      raise ValueError(f"pools[{i}] must have shape [P, S_page] or [P, S_page, H] with "
                       f"P, S_page = {(p, s)}, got {pool.shape}")
  if page_table.ndim != 2 or page_table.dtype != jnp.int32:
    raise ValueError(f"page_table must be int32 [R, P_max], got {page_table.dtype} "
                     f"{page_table.shape}")
  r = page_table.shape[0]
  if lengths.shape != (r,) or lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32 [R] = ({r},), got {lengths.dtype} {lengths.shape}")
  if keep.ndim != 2 or keep.shape[0] != r or keep.dtype != jnp.int32:
    raise ValueError(f"keep must be int32 [R, S_keep] with R = {r}, got {keep.dtype} "
                     f"{keep.shape}")


def _call_dma(pools, src_page, src_off, dst_page, new_len, *, fills, interpret):
  pltpu = platform.tpu()
  r, p_max = dst_page.shape
  page_size = pools[0].shape[1]
  n = len(pools)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(compact_dma_kernel, num_pools=n, page_size=page_size,
                             pages_max=p_max, fills=fills)
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(r,), in_specs=[any_spec] * n, out_specs=[any_spec] * n,
          scratch_shapes=[pltpu.VMEM(x.shape[1:], x.dtype) for x in pools]),
      input_output_aliases={4 + i: i for i in range(n)},
      compiler_params=platform.compiler_params(platform.TPU, 1),
      interpret=interpret,
  )(src_page.reshape(-1), src_off.reshape(-1), dst_page.reshape(-1), new_len, *pools)


def _call_gather(pools, src_page, src_off, dst_page, new_len, *, fills, interpret):
  r, p_max = dst_page.shape
  num_pages, page_size = pools[0].shape[:2]
  p_pad = pl.next_power_of_2(p_max)
  src = jnp.pad((src_page * page_size + src_off).reshape(r, p_max, page_size),
                ((0, 0), (0, p_pad - p_max), (0, 0))).reshape(r, p_pad * page_size)
  dst = jnp.pad(dst_page, ((0, 0), (0, p_pad - p_max)), constant_values=-1)
  flat = [x.reshape(num_pages * page_size, *x.shape[2:]) for x in pools]
  whole = [pl.BlockSpec(x.shape, lambda ri, nd=x.ndim: (0,) * nd) for x in flat]
  n = len(pools)
  kernel = functools.partial(compact_gather_kernel, num_pools=n, page_size=page_size,
                             fills=fills, barrier=not interpret)
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
      grid=(r,),
      in_specs=[pl.BlockSpec((None, p_pad * page_size), lambda ri: (ri, 0)),
                pl.BlockSpec((None, p_pad), lambda ri: (ri, 0)),
                pl.BlockSpec((1,), lambda ri: (ri,))] + whole,
      out_specs=whole,
      input_output_aliases={3 + i: i for i in range(n)},
      compiler_params=platform.compiler_params(platform.GPU, 1),
      interpret=interpret,
  )(src, dst, new_len, *flat)
  return [o.reshape(x.shape) for o, x in zip(outs, pools)]


@functools.partial(jax.jit, static_argnames=("fills", "interpret"), donate_argnames=("pools",))
def compact_slots(pools, page_table, lengths, keep, *, fills, interpret=False):
  """Compacts kept entries in place (Pallas); same contract as the reference.

  Args:
    pools: tuple of [P, S_page] or [P, S_page, H] arrays (donated: updated in place).
    page_table: [R, P_max] int32; lengths: [R] int32.
    keep: [R, S_keep] int32 slots to keep (-1 = none; any order).
    fills: per pool, the value slots past the new length take on the last
      kept page (None: untouched), e.g. (None, None, -1, 0.0) for keys,
      values, positions, scores.
    interpret: run in Pallas' interpreter; a ``pltpu.InterpretParams`` (or
      ``force_tpu_interpret_mode``) selects the TPU form.

  Returns:
    (pools, page_table [R, P_max] without the freed pages, lengths [R],
    freed [R, P_max] page ids, -1 elsewhere). The caller puts the freed pages
    back on its free list (``PagedKVCache.release`` also clears their metadata).
  """
  _validate(pools, page_table, lengths, keep, fills)
  pools = tuple(pools)
  page_size = pools[0].shape[1]
  src_page, src_off, dst_page, new_len, freed = plan_moves(page_table, lengths, keep, page_size)
  form = platform.lowering(interpret)
  if form == platform.GPU and not interpret:
    for x in pools:
      if any(d & (d - 1) for d in x.shape[1:]):
        raise ValueError(f"the GPU (Triton) kernel needs power-of-two page_size and head "
                         f"dim, got pool shape {x.shape}")
  call = _call_dma if form == platform.TPU else _call_gather
  out = call(pools, src_page, src_off, dst_page, new_len, fills=fills, interpret=interpret)
  return tuple(out), dst_page, new_len, freed


def compact_pages(page_table: jax.Array, lengths: jax.Array, keep_pages: jax.Array,
                  page_size: int):
  """Whole-page eviction: kept pages move to the front of each row's table; no data moves.

  Args:
    page_table: [R, P_max] int32; lengths: [R] int32.
    keep_pages: bool [R, P_max], pages (by table index) to keep; entries past
      a row's owned pages are ignored.
    page_size: S_page.

  Returns:
    (page_table, lengths, freed [R, P_max]). Only a row's last owned page may
    be partly filled; kept, it stays last, so the new length is the kept
    pages' filled slots.
  """
  if page_table.ndim != 2 or keep_pages.shape != page_table.shape:
    raise ValueError(f"page_table [R, P_max] and keep_pages must match, got {page_table.shape} "
                     f"and {keep_pages.shape}")
  r, p_max = page_table.shape
  j = jnp.arange(p_max)[None, :]
  filled = jnp.clip(lengths[:, None] - j * page_size, 0, page_size)  # [R, P_max]
  keep = keep_pages & (filled > 0) & (page_table >= 0)
  order = jnp.argsort(~keep, axis=1, stable=True)  # kept first, in table order
  table = jnp.where(jnp.take_along_axis(keep, order, 1),
                    jnp.take_along_axis(page_table, order, 1), -1)
  freed = jnp.where(keep | (page_table < 0), -1, page_table)
  return table, jnp.sum(jnp.where(keep, filled, 0), axis=1, dtype=jnp.int32), freed
