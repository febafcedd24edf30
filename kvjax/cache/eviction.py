"""The bodies of ``PagedKVCache``'s evictions: ``remove``, ``drop_pages``, ``compact``, ``store_kept``.

Every eviction is one call of the execution's ``compact_slots`` op (the Pallas
kernel, or its jnp reference): kept entries move to their head's first slots,
the head's pages past them go back on the free stack. Each function here only
works out, from the cache's page table and lengths, which slots that one call
keeps, then hands them to ``compact_heads``. They take and return a
``PagedKVCache`` (see its methods for the contracts); this module does not
import it, since ``kvjax.cache.paged`` imports this one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax import execution
from kvjax.cache.shapes import EMPTY, check_array, check_layer, pages_owned
from kvjax.kernels.compaction import canonical_keep

# What an eviction leaves in the slots a head gives up on its last page: keys and
# values as they were (nothing reads past a head's length), no position, no score.
_FILLS = (None, None, EMPTY, 0.0)


def remove(cache, slots: jax.Array, *, ex: execution.Execution | None):
  """``PagedKVCache.remove``: the head's last slot moves into the evicted one."""
  check_array("slots", slots, "[B, L, K]", cache.lengths.shape, "int")
  last = cache.lengths - 1
  evict = (slots >= 0) & (slots <= last)
  new_lengths = cache.lengths - evict.astype(jnp.int32)
  # Evicting the last slot itself moves nothing: start = the new length.
  start = jnp.where(evict, slots, new_lengths)
  return compact_heads(cache, None, cache.page_table, cache.lengths, new_lengths,
                       jnp.maximum(last, 0)[..., None], start, ex=ex)


def drop_pages(cache, index: jax.Array, *, ex: execution.Execution | None):
  """``PagedKVCache.drop_pages``: a page-table edit, then a compaction that frees the page."""
  check_array("index", index, "[B, L, K]", cache.lengths.shape, "int")
  ps = cache.page_size
  p_max = cache.page_table.shape[-1]
  have = pages_owned(cache.page_table)[..., None]  # [B, L, K, 1]
  drop = (index >= 0) & (index < have[..., 0])
  at = jnp.where(drop, index, p_max)[..., None]
  # The page moves behind the head's other pages, where the compaction frees it.
  j = jnp.arange(p_max)
  src = jnp.where(j < at, j, jnp.where(j < have - 1, j + 1, jnp.where(j < have, at, j)))
  table = jnp.take_along_axis(cache.page_table, jnp.minimum(src, p_max - 1), axis=-1)
  lost = jnp.clip(cache.lengths - jnp.where(drop, index, 0) * ps, 0, ps)
  new_lengths = cache.lengths - jnp.where(drop, lost, 0).astype(jnp.int32)
  return compact_heads(cache, None, table, new_lengths, new_lengths,
                       jnp.full(new_lengths.shape + (1,), EMPTY, jnp.int32), new_lengths,
                       ex=ex)


def compact(cache, layer, keep: jax.Array, *, ex: execution.Execution | None):
  """``PagedKVCache.compact``: ``keep`` made canonical (sorted, deduplicated) first."""
  check_layer(layer, cache.num_layers)
  b, kh = cache.batch_size, cache.num_kv_heads
  check_array("keep", keep, "[B, K, S_keep]", (b, kh, None), "int")
  table, lengths = cache.layer_view(layer)
  kept, count = canonical_keep(keep.reshape(b * kh, -1), lengths.reshape(-1))
  return compact_heads(cache, layer, table, lengths, count.reshape(b, kh),
                       kept.reshape(b, kh, -1), jnp.zeros((b, kh), jnp.int32), ex=ex)


def store_kept(cache, layer, keep: jax.Array, entries: tuple[jax.Array, ...], *,
               ex: execution.Execution | None):
  """``PagedKVCache.store_kept``: pages reserved for the kept count, then one compaction
  whose sources are ``entries`` instead of the pools."""
  check_layer(layer, cache.num_layers)
  b, kh, h = cache.batch_size, cache.num_kv_heads, cache.k_pages.shape[-1]
  check_array("keep", keep, "[B, K, U]", (b, kh, None), "bool")
  u = keep.shape[-1]
  kinds = ("float", "float", "int", "float")
  for name, x, kind, tail in zip(("keys", "values", "positions", "scores"), entries, kinds,
                                 ((h,), (h,), (), ())):
    check_array(name, x, "[B, K, U" + (", H]" if tail else "]"), (b, kh, u) + tail, kind)
  # Kept entries first, in order: the entry each of the head's slots takes.
  order = jnp.argsort(~keep, axis=-1, stable=True)[..., :cache.max_slots].astype(jnp.int32)
  _, lengths = cache.layer_view(layer)
  out = cache.set_lengths(layer, keep.sum(-1, dtype=jnp.int32))
  out = out.reserve(out.lengths)
  table, new_lengths = out.layer_view(layer)
  return compact_heads(out, layer, table, lengths, new_lengths, order,
                       jnp.zeros((b, kh), jnp.int32), sources=entries, ex=ex)


def compact_heads(cache, layer, table, lengths, new_lengths, keep, start, sources=None, *,
                  ex: execution.Execution | None):
  """One ``compact_slots`` call over the heads of one layer (``layer``) or of all (None).

  Args:
    table: [B, (L,) K, P_max] the heads' pages; lengths, new_lengths, start:
      [B, (L,) K]; keep: [B, (L,) K, M]; sources: None or the pools' entries
      [B, (L,) K, U, ...] (see ``kvjax.kernels.compaction``).
  """
  heads = table.shape[:-1]
  r = math.prod(heads)
  rows = lambda x: x.reshape((r,) + x.shape[len(heads):])
  pools = (cache.k_pages, cache.v_pages, cache.positions, cache.scores)
  pools, table, freed = execution.of(ex).impl("compact_slots")(
      pools, rows(table), rows(lengths), rows(new_lengths), rows(keep), rows(start),
      fills=_FILLS, sources=None if sources is None else tuple(map(rows, sources)))
  table = table.reshape(heads + (-1,))
  new_lengths = new_lengths.astype(jnp.int32)
  if layer is not None:
    table = cache.page_table.at[:, layer].set(table)
    new_lengths = cache.lengths.at[:, layer].set(new_lengths)
  out = cache.replace(k_pages=pools[0], v_pages=pools[1], positions=pools[2], scores=pools[3],
                      page_table=table, lengths=new_lengths)
  return out.release(freed.reshape(-1))
