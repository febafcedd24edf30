"""Compaction: the reference against hand values, the Pallas kernel (interpret mode:
generic/GPU form and TPU DMA form) against the reference, in place under donation,
lowering for TPU and GPU, whole-page eviction, and a round trip through PagedKVCache.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.experimental.pallas import tpu as pltpu

from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.cache.paged import PagedKVCache
from kvjax.kernels import compaction
from kvjax.kernels.compaction import compact_pages
from kvjax.kernels.compaction import compact_slots
from kvjax.kernels.compaction import compact_slots_reference
from kvjax.kernels.paged_attention import gather_pages

_FILLS = (None, None, -1, 0.0)  # keys, values, positions, scores


def _pools(seed, *, num_pages, page_size, h, dtype):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((num_pages, page_size, h)), dtype),
          jnp.asarray(rng.standard_normal((num_pages, page_size, h)), dtype),
          jnp.asarray(rng.integers(0, 1000, (num_pages, page_size)), jnp.int32),
          jnp.asarray(rng.random((num_pages, page_size)), jnp.float32))


def _rows(seed, *, lengths, page_size, p_max, num_pages, s_keep):
  """Page tables owning ceil(length / page_size) shuffled pages, and messy keep lists:
  unsorted, with duplicates, -1 and slots past the length."""
  rng = np.random.default_rng(seed)
  r = len(lengths)
  order = rng.permutation(num_pages)
  table = np.full((r, p_max), -1, np.int32)
  i = 0
  for ri, n in enumerate(lengths):
    used = -(-n // page_size)
    table[ri, :used] = order[i:i + used]
    i += used
  keep = rng.integers(-1, p_max * page_size + 3, (r, s_keep)).astype(np.int32)
  return jnp.asarray(table), jnp.asarray(np.asarray(lengths, np.int32)), jnp.asarray(keep)


def _copy(pools):
  return tuple(jnp.array(x, copy=True) for x in pools)


def _assert_same(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))


def _filled_cache(b=2, l=2, kh=2, h=64, ps=8, t=29, seed=0):
  """A cache whose heads hold 29, 13, 0 and 20 entries in every layer (positions 100 + t)."""
  cache = PagedKVCache.create(batch_size=b, capacity=32, num_layers=l, num_kv_heads=kh,
                              head_dim=h, page_size=ps)
  rng = np.random.default_rng(seed)
  for layer in range(l):
    k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
    lengths = jnp.array([[29, 13], [0, 20]], jnp.int32)
    slots = jnp.where(jnp.arange(t)[None, None] < lengths[..., None], jnp.arange(t), -1)
    cache = cache.set_lengths(layer, lengths)
    cache = cache.reserve(cache.lengths)
    cache = cache.write(layer, k, v, slots, jnp.broadcast_to(jnp.arange(t) + 100, (b, t)))
  return cache


class ReferenceByHandTest(absltest.TestCase):

  def test_keeps_slots_in_order_and_frees_pages(self):
    # Page size 2; the row owns pages 5, 1, 3 and 5 slots holding 10..14. Keeping
    # slots 4, 1 (any order, a duplicate, a slot past the length) leaves [11, 14] in
    # page 5; pages 1 and 3 are freed.
    pos = jnp.full((6, 2), -1, jnp.int32)
    pos = pos.at[5].set(jnp.array([10, 11])).at[1].set(jnp.array([12, 13])).at[3, 0].set(14)
    (out,), table, lengths, freed = compact_slots_reference(
        (pos,), jnp.array([[5, 1, 3]], jnp.int32), jnp.array([5], jnp.int32),
        jnp.array([[4, 1, 4, 7, -1]], jnp.int32), fills=(-1,))
    np.testing.assert_array_equal(out[5], [11, 14])
    np.testing.assert_array_equal(table, [[5, -1, -1]])
    np.testing.assert_array_equal(lengths, [2])
    np.testing.assert_array_equal(freed, [[-1, 1, 3]])

  def test_fill_past_the_new_length(self):
    k = jnp.arange(8.0).reshape(2, 2, 2)  # pages 0 and 1, page size 2, H = 2
    (kp, pp), _, lengths, freed = compact_slots_reference(
        (k, jnp.ones((2, 2), jnp.int32)), jnp.array([[0, 1]], jnp.int32),
        jnp.array([4], jnp.int32), jnp.array([[2]], jnp.int32), fills=(None, -1))
    np.testing.assert_array_equal(kp[0], [[4.0, 5.0], [2.0, 3.0]])  # slot 1 untouched
    np.testing.assert_array_equal(pp[0], [1, -1])
    np.testing.assert_array_equal(lengths, [1])
    np.testing.assert_array_equal(freed, [[-1, 1]])

  def test_compact_pages(self):
    # Page size 4, lengths 11 (pages 7, 2, 9; the last holds 3) and 8 (pages 4, 6).
    table = jnp.array([[7, 2, 9], [4, 6, -1]], jnp.int32)
    keep = jnp.array([[False, True, True], [True, False, True]])
    new_table, lengths, freed = compact_pages(table, jnp.array([11, 8], jnp.int32), keep, 4)
    np.testing.assert_array_equal(new_table, [[2, 9, -1], [4, -1, -1]])
    np.testing.assert_array_equal(lengths, [7, 4])
    np.testing.assert_array_equal(freed, [[7, -1, -1], [-1, 6, -1]])


# (dtype, page_size, head_dim): every value of every axis. Lengths are ragged: empty,
# one slot, a partial last page, full.
_GRID = ((jnp.float32, 8, 64), (jnp.bfloat16, 16, 128), (jnp.float32, 32, 128),
         (jnp.bfloat16, 8, 64))


class CompactSlotsKernelTest(parameterized.TestCase):

  def _case(self, seed, dtype, page_size, h, p_max=4):
    lengths = [0, 1, page_size + 3, p_max * page_size, 2 * page_size - 1]
    num_pages = len(lengths) * p_max + 2
    pools = _pools(seed, num_pages=num_pages, page_size=page_size, h=h, dtype=dtype)
    rows = _rows(seed, lengths=lengths, page_size=page_size, p_max=p_max, num_pages=num_pages,
                 s_keep=2 * page_size)
    return pools, rows

  @parameterized.parameters(*_GRID)
  def test_matches_reference(self, dtype, page_size, h):
    pools, rows = self._case(page_size + h, dtype, page_size, h)
    want = compact_slots_reference(pools, *rows, fills=_FILLS)
    got = compact_slots(_copy(pools), *rows, fills=_FILLS, interpret=True)
    _assert_same(got, want)

  @parameterized.parameters((jnp.float32, 8, 64), (jnp.bfloat16, 16, 128))
  def test_tpu_form_matches_reference(self, dtype, page_size, h):
    pools, rows = self._case(7, dtype, page_size, h, p_max=3)
    want = compact_slots_reference(pools, *rows, fills=_FILLS)
    with pltpu.force_tpu_interpret_mode():
      got = compact_slots(_copy(pools), *rows, fills=_FILLS, interpret=True)
    _assert_same(got, want)

  def test_updates_donated_pools_in_place(self):
    pools, rows = self._case(3, jnp.float32, 8, 64)
    mine = _copy(pools)
    got = compact_slots(mine, *rows, fills=_FILLS, interpret=True)
    self.assertTrue(all(x.is_deleted() for x in mine))
    _assert_same(got, compact_slots_reference(pools, *rows, fills=_FILLS))

  def test_backend_switch(self):
    pools, rows = self._case(4, jnp.float32, 8, 64)
    want = backend_lib.get("compact_slots", "xla")(pools, *rows, fills=_FILLS)
    got = backend_lib.get("compact_slots", "pallas")(_copy(pools), *rows, fills=_FILLS)
    _assert_same(got, want)

  @parameterized.parameters(("tpu", compaction._call_dma, "tpu_custom_call"),
                            ("cuda", compaction._call_gather, "triton"))
  def test_lowers_for_platform(self, plat, call, marker):
    p, s, h, r, p_max = 64, 16, 128, 6, 8
    pools = (jax.ShapeDtypeStruct((p, s, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((p, s, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((p, s), jnp.int32), jax.ShapeDtypeStruct((p, s), jnp.float32))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    fn = functools.partial(call, fills=_FILLS, interpret=False)
    lowered = jax.jit(fn).trace(pools, i32(r, p_max * s), i32(r, p_max * s), i32(r, p_max),
                                i32(r)).lower(lowering_platforms=(plat,))
    self.assertIn(marker, lowered.as_text())

  def test_cache_round_trip(self):
    # Compact layer 1 of a real cache, give the freed pages back: the page accounting
    # holds, and each head keeps exactly the chosen original positions, in order.
    b, kh, t = 2, 2, 29
    cache = _filled_cache(b=b, kh=kh, t=t)
    rng = np.random.default_rng(0)
    table, lengths = cache.layer_view(1)
    keep = jnp.asarray(rng.integers(0, t, (b, kh, 12)), jnp.int32)
    pools = (cache.k_pages, cache.v_pages, cache.positions, cache.scores)
    (kp, vp, pos, sc), new_table, new_len, freed = compact_slots(
        pools, table.reshape(b * kh, -1), lengths.reshape(-1), keep.reshape(b * kh, -1),
        fills=_FILLS, interpret=True)
    cache = cache.replace(k_pages=kp, v_pages=vp, positions=pos, scores=sc,
                          page_table=cache.page_table.at[:, 1].set(new_table.reshape(b, kh, -1)),
                          lengths=cache.lengths.at[:, 1].set(new_len.reshape(b, kh)))
    cache = cache.release(freed.reshape(-1))
    testing.assert_cache_consistent(cache)
    kept = np.asarray(cache.kept_positions())[:, 1]
    for bi in range(b):
      for ki in range(kh):
        want = sorted({int(s) for s in np.asarray(keep)[bi, ki]
                       if s < int(lengths[bi, ki])})
        np.testing.assert_array_equal(kept[bi, ki, :len(want)], np.asarray(want) + 100)
        self.assertTrue((kept[bi, ki, len(want):] == -1).all())
    # Layer 0 is untouched.
    self.assertEqual(np.asarray(cache.lengths)[:, 0].tolist(), [[29, 13], [0, 20]])


class CompactFromEntriesTest(absltest.TestCase):
  """``PagedKVCache.compact(..., entries=)`` takes keys and values from what was read."""

  def test_same_cache_as_compacting_from_the_pools(self):
    cache = _filled_cache()
    keep = jnp.asarray(np.random.default_rng(1).integers(-1, 33, (2, 2, 12)), jnp.int32)
    table, _ = cache.layer_view(1)
    entries = (gather_pages(cache.k_pages, table), gather_pages(cache.v_pages, table))
    want = cache.compact(1, keep)
    got = cache.compact(1, keep, entries=entries)
    testing.assert_cache_consistent(got)
    _assert_same(got, want)
    with self.assertRaisesRegex(ValueError, r"values must have shape \[B, K, S, H\]"):
      cache.compact(1, keep, entries=(entries[0], entries[1][:, :, :8]))

  def test_a_read_then_compact_program_updates_the_pools_in_place(self):
    # The keys decide what is kept, the values are only read: from the pools, XLA
    # copies the value pool; from the read entries, it copies nothing. (Eight layers:
    # the pool is larger than a layer's reads.)
    cache = _filled_cache(l=8)

    def program(cache, entries_given):
      table, _ = cache.layer_view(1)
      keys, values = gather_pages(cache.k_pages, table), gather_pages(cache.v_pages, table)
      keep = jnp.argsort(-keys[..., 0], axis=-1)[..., :10].astype(jnp.int32)
      out = cache.compact(1, keep, entries=(keys, values) if entries_given else None)
      return out, values.sum()

    def scratch(entries_given):
      fn = jax.jit(functools.partial(program, entries_given=entries_given), donate_argnums=0)
      return fn.lower(cache).compile().memory_analysis().temp_size_in_bytes

    pool = cache.v_pages.nbytes
    self.assertGreaterEqual(scratch(False), pool)
    self.assertLess(scratch(True), pool)


class ValidationTest(parameterized.TestCase):

  def _good(self):
    return dict(pools=(jnp.zeros((4, 8, 16)),), page_table=jnp.zeros((2, 2), jnp.int32),
                lengths=jnp.zeros((2,), jnp.int32), keep=jnp.zeros((2, 3), jnp.int32),
                fills=(None,))

  @parameterized.named_parameters(
      ("fills", dict(fills=(None, 0)), "fills must be a tuple with one entry"),
      ("pool_shape", dict(pools=(jnp.zeros((4, 8, 16)), jnp.zeros((4, 4))), fills=(None, 0)),
       r"pools\[1\] must have shape \[P, S_page\] or \[P, S_page, H\] with P, S_page = "
       r"\(4, 8\), got \(4, 4\)"),
      ("table", dict(page_table=jnp.zeros((2, 2), jnp.int16)),
       r"page_table must be int32 \[R, P_max\], got int16"),
      ("lengths", dict(lengths=jnp.zeros((3,), jnp.int32)),
       r"lengths must be int32 \[R\] = \(2,\), got int32 \(3,\)"),
      ("keep", dict(keep=jnp.zeros((1, 3), jnp.int32)),
       r"keep must be int32 \[R, S_keep\] with R = 2, got int32 \(1, 3\)"),
  )
  def test_bad_input(self, overrides, message):
    args = {**self._good(), **overrides}
    with self.assertRaisesRegex(ValueError, message):
      compact_slots(**args, interpret=True)
    with self.assertRaisesRegex(ValueError, message):
      compact_slots_reference(**args)


if __name__ == "__main__":
  absltest.main()
