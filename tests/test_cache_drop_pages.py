"""PagedKVCache.drop_pages: one whole page per head leaves, order kept, the page freed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import testing
from kvjax.cache import PagedKVCache

PS = 4


def _filled(lengths):
  """A cache (B=1, L=1, K=2) whose head h holds positions 0..lengths[h]-1 in order."""
  cache = PagedKVCache.create(batch_size=1, capacity=5 * PS, num_layers=1, num_kv_heads=2,
                              head_dim=2, page_size=PS)
  t = max(lengths)
  lengths = jnp.asarray([[lengths]], jnp.int32)
  cache = cache.set_lengths(0, lengths[:, 0]).reserve(lengths)
  slots = jnp.where(jnp.arange(t)[None, None] < lengths[0, 0][None, :, None],
                    jnp.arange(t, dtype=jnp.int32)[None, None], -1)
  k = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None, None], (1, t, 2, 2))
  return cache.write(0, k, k, slots, jnp.arange(t, dtype=jnp.int32)[None])


def test_drops_a_middle_page_and_keeps_order():
  cache = _filled((18, 13))  # head 0: pages 0-4 (last holds 2); head 1: pages 0-3 (last 1)
  free_before = int(cache.num_free)
  pages_before = np.asarray(cache.page_table[0, 0])
  out = cache.drop_pages(jnp.asarray([[[1, 2]]], jnp.int32))
  testing.assert_cache_consistent(out)
  kept = np.asarray(out.kept_positions()[0, 0])
  assert kept[0][:14].tolist() == [0, 1, 2, 3] + list(range(8, 18))
  assert kept[1][:9].tolist() == list(range(8)) + [12]
  np.testing.assert_array_equal(out.lengths[0, 0], [14, 9])
  assert int(out.num_free) == free_before + 2
  # Only the page table changed for head 0's other pages: the same pages, shifted.
  table = np.asarray(out.page_table[0, 0])
  assert table[0].tolist() == [pages_before[0][0]] + pages_before[0][2:5].tolist() + [-1]
  # Keys follow their positions (nothing moved inside the pool).
  keys = np.asarray(out.k_pages[jnp.maximum(out.page_table[0, 0, 0], 0)]).reshape(-1, 2)[:14, 0]
  assert keys.tolist() == kept[0][:14].tolist()


def test_minus_one_and_out_of_range_do_nothing():
  cache = _filled((9, 9))
  out = cache.drop_pages(jnp.asarray([[[-1, 7]]], jnp.int32))
  np.testing.assert_array_equal(out.page_table, cache.page_table)
  np.testing.assert_array_equal(out.lengths, cache.lengths)
  assert int(out.num_free) == int(cache.num_free)


def test_dropping_the_tail_page_loses_what_it_holds():
  cache = _filled((9, 8))
  out = cache.drop_pages(jnp.asarray([[[2, 1]]], jnp.int32))
  testing.assert_cache_consistent(out)
  np.testing.assert_array_equal(out.lengths[0, 0], [8, 4])


def test_freed_page_is_reused_by_the_next_append():
  cache = _filled((8, 8))
  out = jax.jit(lambda c: c.drop_pages(jnp.asarray([[[1, 1]]], jnp.int32)))(cache)
  out = out.reserve(out.lengths + 1)
  testing.assert_cache_consistent(out)
  assert int(out.num_free) == int(cache.num_free)  # 2 freed, 2 taken again


def test_bad_shape_raises():
  with pytest.raises(ValueError, match=r"index must have shape \[B, L, K\]"):
    _filled((4, 4)).drop_pages(jnp.zeros((1, 2), jnp.int32))
