"""Compaction, the eviction kernel: each row keeps some entries in its first slots, in a
given order, and gives up the pages past them.

Layout (one row r per (sequence[, layer], KV head); callers flatten their heads
into R rows; slot s of a row is offset s % S_page of page page_table[r, s // S_page]):
  pools        tuple of [P, S_page, ...] arrays moved together (keys, values,
               and per-slot metadata such as original positions and scores)
  page_table   [R, P_max] int32 page ids of each row, -1 = none
  lengths      [R] int32 entries each row holds before
  new_lengths  [R] int32 entries it holds after (n_r); its first
               ceil(n_r / S_page) pages must be allocated
  keep, start  [R, M] int32 and [R] int32: destination slot start_r + i takes
               the entry keep[r, i] (for start_r + i < n_r; -1 leaves the slot
               as it is). Slots below n_r outside that range keep their entry.
  sources      None: an entry is a slot of the row (in the pool, compacted in
               place); or one [R, U, ...] array per pool: an entry is a row of
               the row's source (a store from scratch: entries that were never
               in the pool, or were read from it)

Slots in [n_r, lengths_r) of the row's last kept page take each pool's ``fill``
(None leaves them as they were); pages past ceil(n_r / S_page) leave the table
and come back as ``freed``. Every eviction is one of these calls:
  keep a set of slots   start 0, keep = the slots in increasing order, n = their count
  evict a token         start = its slot, keep = [the last slot], n = length - 1
  evict a page          the page moved behind the row's other pages, n = length
                        minus its entries, nothing moved (a page-table edit)
  store from scratch    sources = the entries, keep = the kept ones in order, n = their count

Two implementations with one contract:
  compact_slots_reference   jnp, out of place; gathers the M entries and
                            scatters them (O(M) work per row, not O(S)).
  compact_slots             Pallas, in place: the pools are aliased to the
                            outputs (``input_output_aliases``) and donated by
                            the jitted wrapper. One grid program per row; it
                            rewrites only the pages that change (those of the
                            moved range, and the last kept page when filled),
                            in increasing order, reading each page's entries
                            before writing it. In the in-pool form an entry
                            must therefore lie in its destination's page or a
                            later one (not yet rewritten): slots kept in
                            increasing order, and a later slot moved into an
                            earlier one, both do. Rows own disjoint pages.
    TPU form: pools and sources stay in HBM (``pl.ANY``); table, entries and
      per-row plan are scalar-prefetched; a page is DMAed into a VMEM buffer,
      its moved entries DMAed over their slots, and the buffer DMAed back.
    GPU form: pools (and sources) are flattened to [P * S_page, ...] rows; the
      kernel gathers a page's entries and scatters them, with a barrier
      between (the threads of a program load and store different slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.kernels import platform

_BIG = jnp.iinfo(jnp.int32).max
# Per-row plan handed to the kernels: n, lengths, start, first page, end of the
# moved pages, the filled page (-1: none); padded to a power of two for Triton.
_PLAN = 8

# ------------------------------------------------------------------ index maps (shared)


def canonical_keep(keep: jax.Array, lengths: jax.Array):
  """Sorted distinct kept slots in [0, length) first, then -1: ([R, S_keep], their count [R]).

  Turns a set of slots to keep (any order, duplicates, out of range) into the
  ``keep`` of a compaction that starts at slot 0.
  """
  valid = (keep >= 0) & (keep < lengths[:, None])
  x = jnp.sort(jnp.where(valid, keep, _BIG), axis=1)
  dup = jnp.pad(x[:, 1:] == x[:, :-1], ((0, 0), (1, 0))) & (x != _BIG)
  x = jnp.sort(jnp.where(dup, _BIG, x), axis=1)
  kept = x != _BIG
  return jnp.where(kept, x, -1), kept.sum(axis=1, dtype=jnp.int32)


def _plan(lengths, new_lengths, start, moves: int, page_size: int, pages_max: int):
  """[R, _PLAN] int32: what a row's kernel program rewrites.

  Pages [first, end) hold the moved range's destinations; ``filled`` is the
  last kept page when it has slots in [n, lengths) to fill (-1 otherwise).
  """
  start = jnp.maximum(start, 0)
  stop = jnp.minimum(start + moves, new_lengths)
  moving = stop > start
  first = jnp.where(moving, jnp.minimum(start // page_size, pages_max), 0)
  end = jnp.where(moving, jnp.minimum(-(-stop // page_size), pages_max), 0)
  partial = (new_lengths % page_size != 0) & (lengths > new_lengths)
  filled = jnp.where(partial & (new_lengths < pages_max * page_size),
                     new_lengths // page_size, -1)
  zero = jnp.zeros_like(start)
  return jnp.stack([new_lengths, lengths, start, first, end, filled, zero, zero],
                   axis=1).astype(jnp.int32)


def _split_table(page_table, new_lengths, page_size):
  """(the kept pages [R, P_max], -1 past them; the freed pages, -1 elsewhere)."""
  stays = jnp.arange(page_table.shape[1])[None, :] < -(-new_lengths // page_size)[:, None]
  return jnp.where(stays, page_table, -1), jnp.where(stays, -1, page_table)


def _slot_page(page_table, slots, page_size):
  """The page holding each slot [R, M] of its row (-1 outside the table)."""
  p_max = page_table.shape[1]
  j = slots // page_size
  page = jnp.take_along_axis(page_table, jnp.clip(j, 0, p_max - 1), axis=1)
  return jnp.where((slots >= 0) & (j < p_max), page, -1)


def _fill_mask(slots, new_len, length):
  """bool of ``slots``' shape: the slot lies in [n, lengths), where a fill goes."""
  return (slots >= new_len) & (slots < length)


def _rows_like(mask, x):
  """``mask`` [S] broadcast to ``x`` [S, ...]."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def _rewrite_pages(rewrite, first, end, filled):
  """Calls ``rewrite(j)`` for the pages j in [first, end), then for ``filled`` past them."""

  def page(j, carry):
    rewrite(j)
    return carry

  jax.lax.fori_loop(first, end, page, 0)

  @pl.when(filled >= end)
  def _():
    rewrite(filled)


# ------------------------------------------------------------------ reference


def compact_slots_reference(pools, page_table, lengths, new_lengths, keep, start, *, fills,
                            sources=None):
  """Out-of-place reference; returns (pools, page_table, freed [R, P_max])."""
  _validate(pools, page_table, lengths, new_lengths, keep, start, fills, sources)
  num_pages, page_size = pools[0].shape[:2]
  m = keep.shape[1]
  dest = jnp.maximum(start, 0)[:, None] + jnp.arange(m)  # [R, M]
  moved = (keep >= 0) & (dest < new_lengths[:, None])
  dst_page = _slot_page(page_table, dest, page_size)
  dst_page = jnp.where(moved & (dst_page >= 0), dst_page, num_pages)  # not moved: dropped
  if sources is None:
    src_page = jnp.maximum(_slot_page(page_table, keep, page_size), 0)
    taken = [pool[src_page, jnp.maximum(keep, 0) % page_size] for pool in pools]
  else:
    row = jnp.clip(keep, 0, sources[0].shape[1] - 1)
    taken = [jnp.take_along_axis(x, _rows_like(row, x), axis=1) for x in sources]
  # The last kept page's slots in [n, lengths).
  last = new_lengths // page_size
  slot = last[:, None] * page_size + jnp.arange(page_size)  # [R, S_page]
  fill_page = _slot_page(page_table, slot, page_size)
  fill_at = (_fill_mask(slot, new_lengths[:, None], lengths[:, None])
             & (new_lengths % page_size != 0)[:, None] & (fill_page >= 0))
  fill_page = jnp.where(fill_at, fill_page, num_pages)
  out = []
  for pool, x, fill in zip(pools, taken, fills):
    pool = pool.at[dst_page, dest % page_size].set(x.astype(pool.dtype), mode="drop")
    if fill is not None:
      pool = pool.at[fill_page, slot % page_size].set(jnp.asarray(fill, pool.dtype), mode="drop")
    out.append(pool)
  return (tuple(out),) + _split_table(page_table, new_lengths, page_size)


# ------------------------------------------------------------------ kernels


def compact_dma_kernel(table_ref, keep_ref, plan_ref, *refs, num_pools: int, from_sources: bool,
                       page_size: int, pages_max: int, moves: int, fills):
  """TPU form, grid (R,). Scalar-prefetched (SMEM): table [R * P_max], keep [R * M],
  plan [R * _PLAN]. refs: the pools (aliased inputs, unused), the sources (HBM; in
  the from-scratch form), the pools (outputs, HBM), one VMEM page buffer per pool."""
  pltpu = platform.tpu()
  num_sources = num_pools if from_sources else 0
  sources = refs[num_pools:num_pools + num_sources]
  outs = refs[num_pools + num_sources:2 * num_pools + num_sources]
  bufs = refs[2 * num_pools + num_sources:]
  row = pl.program_id(0)
  new_len, length, start, first, end, filled = (plan_ref[row * _PLAN + i] for i in range(6))

  def rewrite(j):
    dst = table_ref[row * pages_max + j]

    @pl.when(dst >= 0)
    def _():
      for o, buf in zip(outs, bufs):
        pltpu.sync_copy(o.at[dst], buf)

      def slot(t, carry):
        d = j * page_size + t
        i = d - start
        e = keep_ref[row * moves + jnp.clip(i, 0, moves - 1)]

        @pl.when((d < new_len) & (i >= 0) & (i < moves) & (e >= 0))
        def _():
          if from_sources:
            for x, buf in zip(sources, bufs):
              pltpu.sync_copy(x.at[row, pl.ds(e, 1)], buf.at[pl.ds(t, 1)])
          else:
            page = table_ref[row * pages_max + jax.lax.div(e, page_size)]
            off = jax.lax.rem(e, page_size)
            for o, buf in zip(outs, bufs):
              pltpu.sync_copy(o.at[page, pl.ds(off, 1)], buf.at[pl.ds(t, 1)])

        return carry

      jax.lax.fori_loop(0, page_size, slot, 0)
      for o, buf, fill in zip(outs, bufs, fills):
        if fill is not None:
          d = j * page_size + jax.lax.broadcasted_iota(jnp.int32, buf.shape, 0)
          buf[...] = jnp.where(_fill_mask(d, new_len, length), jnp.asarray(fill, buf.dtype),
                               buf[...])
        pltpu.sync_copy(buf, o.at[dst])

  _rewrite_pages(rewrite, first, end, filled)


def compact_gather_kernel(table_ref, keep_ref, plan_ref, *refs, num_pools: int,
                          from_sources: bool, page_size: int, moves: int, source_rows: int,
                          fills, barrier: bool):
  """GPU form, grid (R,). table_ref [P_pad] the row's pages, keep_ref [M_pad] its
  entries, plan_ref [_PLAN]; refs: the flattened pools [P * S_page, ...] (aliased
  inputs, unused), the flattened sources [R * U, ...] (from-scratch form), then
  the pools as outputs."""
  pltriton = platform.triton()
  num_sources = num_pools if from_sources else 0
  sources = refs[num_pools:num_pools + num_sources]
  outs = refs[num_pools + num_sources:]
  row = pl.program_id(0)
  new_len, length, start, first, end, filled = (plan_ref[i] for i in range(6))
  t = jnp.arange(page_size)

  def rewrite(j):
    dst = table_ref[j]

    @pl.when(dst >= 0)
    def _():
      d = j * page_size + t
      i = d - start
      e = keep_ref[jnp.clip(i, 0, keep_ref.shape[0] - 1)]
      moved = (d < new_len) & (i >= 0) & (i < moves) & (e >= 0)
      own = dst * page_size + t
      if from_sources:
        src = row * source_rows + jnp.clip(e, 0, source_rows - 1)
        rows = [jnp.where(_rows_like(moved, o_rows), x[src], o_rows)
                for x, o_rows in zip(sources, (o[own] for o in outs))]
      else:
        entry = jnp.where(moved, e, d)
        page = jnp.maximum(table_ref[jnp.clip(entry // page_size, 0, table_ref.shape[0] - 1)], 0)
        rows = [o[page * page_size + entry % page_size] for o in outs]
      if barrier:  # every thread has loaded before any overwrites an entry
        pltriton.debug_barrier()
      for o, x, fill in zip(outs, rows, fills):
        if fill is not None:
          x = jnp.where(_rows_like(_fill_mask(d, new_len, length), x),
                        jnp.asarray(fill, x.dtype), x)
        o[own] = x
      if barrier:  # stores of this page land before the next page reads
        pltriton.debug_barrier()

  _rewrite_pages(rewrite, first, end, filled)


# ------------------------------------------------------------------ public wrappers


def _validate(pools, page_table, lengths, new_lengths, keep, start, fills, sources) -> None:
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
  for name, x in (("lengths", lengths), ("new_lengths", new_lengths), ("start", start)):
    if x.shape != (r,) or x.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 [R] = ({r},), got {x.dtype} {x.shape}")
  if keep.ndim != 2 or keep.shape[0] != r or keep.shape[1] < 1 or keep.dtype != jnp.int32:
    raise ValueError(f"keep must be int32 [R, M] with R = {r}, M >= 1, got {keep.dtype} "
                     f"{keep.shape}")
  if sources is None:
    return
  if not isinstance(sources, (tuple, list)) or len(sources) != len(pools):
    raise ValueError(f"sources must be None or a tuple with one array per pool "
                     f"({len(pools)}), got {type(sources).__name__} of "
                     f"{len(sources) if isinstance(sources, (tuple, list)) else '?'}")
  u = sources[0].shape[1] if sources[0].ndim >= 2 else None
  for i, (x, pool) in enumerate(zip(sources, pools)):
    want = (r, u) + pool.shape[2:]
    if x.shape != want:
      raise ValueError(f"sources[{i}] must have shape [R, U{', H' if pool.ndim == 3 else ''}] "
                       f"= {want}, got {x.shape}")


def _call_dma(pools, sources, page_table, keep, plan, *, fills, interpret):
  pltpu = platform.tpu()
  r, p_max = page_table.shape
  page_size = pools[0].shape[1]
  n = len(pools)
  sources = tuple(sources or ())
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(compact_dma_kernel, num_pools=n, from_sources=bool(sources),
                             page_size=page_size, pages_max=p_max, moves=keep.shape[1],
                             fills=fills)
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(r,), in_specs=[any_spec] * (n + len(sources)),
          out_specs=[any_spec] * n,
          scratch_shapes=[pltpu.VMEM(x.shape[1:], x.dtype) for x in pools]),
      input_output_aliases={3 + i: i for i in range(n)},
      compiler_params=platform.compiler_params(platform.TPU, 1),
      interpret=interpret,
  )(page_table.reshape(-1), keep.reshape(-1), plan.reshape(-1), *pools, *sources)


def _call_gather(pools, sources, page_table, keep, plan, *, fills, interpret):
  r, p_max = page_table.shape
  m = keep.shape[1]
  num_pages, page_size = pools[0].shape[:2]
  p_pad, m_pad = pl.next_power_of_2(p_max), pl.next_power_of_2(m)
  table = jnp.pad(page_table, ((0, 0), (0, p_pad - p_max)), constant_values=-1)
  keep = jnp.pad(keep, ((0, 0), (0, m_pad - m)), constant_values=-1)
  flat = [x.reshape(num_pages * page_size, *x.shape[2:]) for x in pools]
  sources = tuple(sources or ())
  source_rows = sources[0].shape[1] if sources else 1
  flat_sources = [x.reshape(r * source_rows, *x.shape[2:]) for x in sources]
  whole = lambda x: pl.BlockSpec(x.shape, lambda ri, nd=x.ndim: (0,) * nd)
  n = len(pools)
  kernel = functools.partial(compact_gather_kernel, num_pools=n, from_sources=bool(sources),
                             page_size=page_size, moves=m, source_rows=source_rows, fills=fills,
                             barrier=not interpret)
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
      grid=(r,),
      in_specs=[pl.BlockSpec((None, p_pad), lambda ri: (ri, 0)),
                pl.BlockSpec((None, m_pad), lambda ri: (ri, 0)),
                pl.BlockSpec((None, _PLAN), lambda ri: (ri, 0))]
               + [whole(x) for x in flat + flat_sources],
      out_specs=[whole(x) for x in flat],
      input_output_aliases={3 + i: i for i in range(n)},
      compiler_params=platform.compiler_params(platform.GPU, 1),
      interpret=interpret,
  )(table, keep, plan, *flat, *flat_sources)
  return [o.reshape(x.shape) for o, x in zip(outs, pools)]


@functools.partial(jax.jit, static_argnames=("fills", "interpret", "target"),
                   donate_argnames=("pools",))
def compact_slots(pools, page_table, lengths, new_lengths, keep, start, *, fills, sources=None,
                  interpret=False, target: str | None = None):
  """Evicts in place (Pallas); same contract as the reference (see the module docstring).

  Args:
    pools: tuple of [P, S_page] or [P, S_page, H] arrays (donated: updated in place).
    page_table: [R, P_max] int32; lengths, new_lengths: [R] int32.
    keep: [R, M] int32, the entry each destination slot start_r + i takes (-1: none).
    start: [R] int32, the first destination slot of each row's moves.
    fills: per pool, the value slots in [n, lengths) of the last kept page take
      (None: untouched), e.g. (None, None, -1, 0.0) for keys, values, positions, scores.
    sources: None (entries are slots of the row, in place) or one [R, U(, H)]
      array per pool (entries are rows of the row's source).
    interpret: run in Pallas' interpreter; a ``pltpu.InterpretParams`` (or
      ``force_tpu_interpret_mode``) selects the TPU form.
    target: the platform whose compiled form to lower to ("gpu", "tpu"; None:
      the default device's); the interpreter runs either form on a CPU.

  Returns:
    (pools, page_table [R, P_max] without the freed pages, freed [R, P_max]
    page ids, -1 elsewhere). The caller puts the freed pages back on its free
    list (``PagedKVCache.release`` also clears their metadata).
  """
  _validate(pools, page_table, lengths, new_lengths, keep, start, fills, sources)
  pools = tuple(pools)
  page_size, p_max = pools[0].shape[1], page_table.shape[1]
  if sources is not None:
    sources = tuple(x.astype(pool.dtype) for x, pool in zip(sources, pools))
  plan = _plan(lengths, new_lengths, start, keep.shape[1], page_size, p_max)
  form = platform.lowering(interpret, target)
  if form == platform.GPU and not interpret:
    for x in pools:
      if any(d & (d - 1) for d in x.shape[1:]):
        raise ValueError(f"the GPU (Triton) kernel needs power-of-two page_size and head "
                         f"dim, got pool shape {x.shape}")
  call = _call_dma if form == platform.TPU else _call_gather
  out = call(pools, sources, page_table, keep, plan, fills=fills, interpret=interpret)
  return (tuple(out),) + _split_table(page_table, new_lengths, page_size)
