"""Compaction, the eviction kernel: the reference against hand values, the Pallas kernel
(interpret mode: generic/GPU form and TPU DMA form) against the reference in each of its
callers' forms (keep a set, evict a token, store from dense entries), in place under
donation, lowering for TPU and GPU at a real model's shapes, and a round trip through
PagedKVCache.
"""

import functools
from unittest import mock

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
from kvjax.kernels.compaction import canonical_keep
from kvjax.kernels.compaction import compact_slots
from kvjax.kernels.compaction import compact_slots_reference
from kvjax.kernels.paged_attention import gather_pages

_FILLS = (None, None, -1, 0.0)  # keys, values, positions, scores


def _pools(rng, shape, h, dtype):
  """Keys, values [*shape, H] in ``dtype``, positions int32 and scores float32 [*shape]."""
  return (jnp.asarray(rng.standard_normal(shape + (h,)), dtype),
          jnp.asarray(rng.standard_normal(shape + (h,)), dtype),
          jnp.asarray(rng.integers(0, 1000, shape), jnp.int32),
          jnp.asarray(rng.random(shape), jnp.float32))


def _table(rng, pages, num_pages, p_max):
  """[R, P_max]: row r owns pages[r] shuffled pages of the pool, -1 after them."""
  order = rng.permutation(num_pages)
  table = np.full((len(pages), p_max), -1, np.int32)
  i = 0
  for r, n in enumerate(pages):
    table[r, :n] = order[i:i + n]
    i += n
  return jnp.asarray(table)


def _copy(pools):
  return tuple(jnp.array(x, copy=True) for x in pools)


def _assert_same(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))


def _case(form, seed, dtype, page_size, h, p_max=4):
  """(pools, args, sources) of one of the callers' forms over ragged rows: empty, one
  slot, a partial last page, full, one short of two pages."""
  rng = np.random.default_rng(seed)
  lengths = [0, 1, page_size + 3, p_max * page_size, 2 * page_size - 1]
  r, s = len(lengths), p_max * page_size
  num_pages = r * p_max + 2
  pools = _pools(rng, (num_pages, page_size), h, dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  zero = jnp.zeros((r,), jnp.int32)
  sources = None
  if form == "set":  # unsorted, duplicates, -1 and slots past the length
    table = _table(rng, -(-np.asarray(lengths) // page_size), num_pages, p_max)
    messy = jnp.asarray(rng.integers(-1, s + 3, (r, 2 * page_size)), jnp.int32)
    keep, new = canonical_keep(messy, lengths)
    args = (table, lengths, new, keep, zero)
  elif form in ("keep_all", "keep_none"):
    table = _table(rng, -(-np.asarray(lengths) // page_size), num_pages, p_max)
    keep = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))
    new = lengths if form == "keep_all" else zero
    args = (table, lengths, new, jnp.where(keep < new[:, None], keep, -1), zero)
  elif form == "token":  # -1, the first slot, a middle one, the last, one past the length
    table = _table(rng, -(-np.asarray(lengths) // page_size), num_pages, p_max)
    slot = jnp.asarray([-1, 0, 3, p_max * page_size - 1, 2 * page_size - 1], jnp.int32)
    evict = (slot >= 0) & (slot < lengths)
    new = lengths - evict.astype(jnp.int32)
    args = (table, lengths, new, jnp.maximum(lengths - 1, 0)[:, None],
            jnp.where(evict, slot, new))
  else:  # "sources", "sources_all", "sources_none": dense entries, every page allocated
    u = s + 5
    table = _table(rng, [p_max] * r, num_pages, p_max)
    sources = _pools(rng, (r, u), h, dtype)
    mask = {"sources": rng.random((r, u)) < 0.4, "sources_all": np.ones((r, u), bool),
            "sources_none": np.zeros((r, u), bool)}[form]
    mask[1] = False  # a row that empties
    keep = jnp.argsort(~jnp.asarray(mask), axis=-1, stable=True)[:, :s].astype(jnp.int32)
    new = jnp.minimum(jnp.asarray(mask.sum(-1), jnp.int32), s)
    args = (table, lengths, new, keep, zero)
  return pools, args, sources


_FORMS = ("set", "keep_all", "keep_none", "token", "sources", "sources_all", "sources_none")


class ReferenceByHandTest(absltest.TestCase):

  def test_keeps_slots_in_order_and_frees_pages(self):
    # Page size 2; the row owns pages 5, 1, 3 and 5 slots holding 10..14. Keeping
    # slots 4, 1 (any order, a duplicate, a slot past the length) leaves [11, 14] in
    # page 5; pages 1 and 3 are freed.
    pos = jnp.full((6, 2), -1, jnp.int32)
    pos = pos.at[5].set(jnp.array([10, 11])).at[1].set(jnp.array([12, 13])).at[3, 0].set(14)
    lengths = jnp.array([5], jnp.int32)
    keep, new = canonical_keep(jnp.array([[4, 1, 4, 7, -1]], jnp.int32), lengths)
    np.testing.assert_array_equal(keep, [[1, 4, -1, -1, -1]])
    (out,), table, freed = compact_slots_reference(
        (pos,), jnp.array([[5, 1, 3]], jnp.int32), lengths, new, keep,
        jnp.zeros((1,), jnp.int32), fills=(-1,))
    np.testing.assert_array_equal(out[5], [11, 14])
    np.testing.assert_array_equal(table, [[5, -1, -1]])
    np.testing.assert_array_equal(freed, [[-1, 1, 3]])

  def test_fill_past_the_new_length(self):
    k = jnp.arange(8.0).reshape(2, 2, 2)  # pages 0 and 1, page size 2, H = 2
    (kp, pp), _, freed = compact_slots_reference(
        (k, jnp.ones((2, 2), jnp.int32)), jnp.array([[0, 1]], jnp.int32),
        jnp.array([4], jnp.int32), jnp.array([1], jnp.int32), jnp.array([[2]], jnp.int32),
        jnp.zeros((1,), jnp.int32), fills=(None, -1))
    np.testing.assert_array_equal(kp[0], [[4.0, 5.0], [2.0, 3.0]])  # slot 1 untouched
    np.testing.assert_array_equal(pp[0], [1, -1])
    np.testing.assert_array_equal(freed, [[-1, 1]])

  def test_token_eviction_moves_the_last_slot_and_touches_nothing_else(self):
    # Page size 2, pages 4, 0, 2 holding positions 0..4; evicting slot 1 moves slot 4
    # (position 4) there, clears it, and frees page 2, now empty.
    pos = jnp.full((5, 2), -1, jnp.int32)
    pos = pos.at[4].set(jnp.array([0, 1])).at[0].set(jnp.array([2, 3])).at[2, 0].set(4)
    (out,), table, freed = compact_slots_reference(
        (pos,), jnp.array([[4, 0, 2]], jnp.int32), jnp.array([5], jnp.int32),
        jnp.array([4], jnp.int32), jnp.array([[4]], jnp.int32), jnp.array([1], jnp.int32),
        fills=(-1,))
    np.testing.assert_array_equal(out[4], [0, 4])
    np.testing.assert_array_equal(out[0], [2, 3])
    np.testing.assert_array_equal(table, [[4, 0, -1]])
    np.testing.assert_array_equal(freed, [[-1, -1, 2]])

  def test_store_from_sources(self):
    # The row holds 3 entries (page 1, then page 0); the source's rows 4, 0, 2 become
    # its slots 0..2, the third page is freed.
    pos = jnp.full((3, 2), 7, jnp.int32)
    src = jnp.array([[10, 11, 12, 13, 14]], jnp.int32)
    (out,), table, freed = compact_slots_reference(
        (pos,), jnp.array([[1, 0, 2]], jnp.int32), jnp.array([3], jnp.int32),
        jnp.array([3], jnp.int32), jnp.array([[4, 0, 2, 3]], jnp.int32),
        jnp.zeros((1,), jnp.int32), fills=(-1,), sources=(src,))
    np.testing.assert_array_equal(out[1], [14, 10])
    np.testing.assert_array_equal(out[0], [12, 7])  # slot 3 was never filled: untouched
    np.testing.assert_array_equal(table, [[1, 0, -1]])
    np.testing.assert_array_equal(freed, [[-1, -1, 2]])


# (dtype, page_size, head_dim): every value of every axis.
_GRID = ((jnp.float32, 8, 64), (jnp.bfloat16, 16, 128), (jnp.float32, 32, 128),
         (jnp.bfloat16, 8, 64))


class CompactSlotsKernelTest(parameterized.TestCase):

  @parameterized.product(form=_FORMS, grid=_GRID)
  def test_matches_reference(self, form, grid):
    dtype, page_size, h = grid
    pools, args, sources = _case(form, page_size + h, dtype, page_size, h)
    want = compact_slots_reference(pools, *args, fills=_FILLS, sources=sources)
    got = compact_slots(_copy(pools), *args, fills=_FILLS, sources=sources, interpret=True)
    _assert_same(got, want)

  @parameterized.product(form=_FORMS, dtype=(jnp.float32, jnp.bfloat16))
  def test_tpu_form_matches_reference(self, form, dtype):
    pools, args, sources = _case(form, 7, dtype, 8, 64, p_max=3)
    want = compact_slots_reference(pools, *args, fills=_FILLS, sources=sources)
    with pltpu.force_tpu_interpret_mode():
      got = compact_slots(_copy(pools), *args, fills=_FILLS, sources=sources, interpret=True)
    _assert_same(got, want)

  def test_updates_donated_pools_in_place(self):
    pools, args, _ = _case("set", 3, jnp.float32, 8, 64)
    mine = _copy(pools)
    got = compact_slots(mine, *args, fills=_FILLS, interpret=True)
    self.assertTrue(all(x.is_deleted() for x in mine))
    _assert_same(got, compact_slots_reference(pools, *args, fills=_FILLS))

  def test_backend_switch(self):
    for form in ("set", "sources"):
      pools, args, sources = _case(form, 4, jnp.float32, 8, 64)
      want = backend_lib.get("compact_slots", "xla")(pools, *args, fills=_FILLS,
                                                     sources=sources)
      got = backend_lib.get("compact_slots", "pallas")(_copy(pools), *args, fills=_FILLS,
                                                       sources=sources)
      _assert_same(got, want)

  # SmolLM2-135M's cache at budget 1024 (30 layers, 3 KV heads, H = 64, page size 16):
  # a decode step's token eviction over every head of every layer (in the pool), and a
  # chunk's store of one layer from its 1024 + 512 dense entries.
  @parameterized.product(
      target=(("tpu", compaction._call_dma, "tpu_custom_call"),
              ("cuda", compaction._call_gather, "triton")),
      shape=((90, 64, 1, None), (3, 64, 1024, 1536)))
  def test_lowers_for_platform(self, target, shape):
    plat, call, marker = target
    r, p_max, m, u = shape
    s, h = 16, 64
    p = 30 * 3 * p_max
    pools = (jax.ShapeDtypeStruct((p, s, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((p, s, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((p, s), jnp.int32), jax.ShapeDtypeStruct((p, s), jnp.float32))
    sources = None if u is None else tuple(
        jax.ShapeDtypeStruct((r, u) + x.shape[2:], x.dtype) for x in pools)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    fn = functools.partial(call, fills=_FILLS, interpret=False)
    lowered = jax.jit(fn).trace(pools, sources, i32(r, p_max), i32(r, m),
                                i32(r, compaction._PLAN)).lower(lowering_platforms=(plat,))
    self.assertIn(marker, lowered.as_text())


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


class CacheTest(parameterized.TestCase):

  @parameterized.parameters("xla", "pallas")
  def test_compact_round_trip(self, backend):
    # Compact layer 1 of a real cache: the page accounting holds, and each head keeps
    # exactly the chosen original positions, in order.
    b, kh, t = 2, 2, 29
    cache = _filled_cache(b=b, kh=kh, t=t)
    rng = np.random.default_rng(0)
    _, lengths = cache.layer_view(1)
    keep = jnp.asarray(rng.integers(0, t, (b, kh, 12)), jnp.int32)
    with backend_lib.use(backend):
      cache = cache.compact(1, keep)
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

  def test_store_kept_from_read_entries_updates_the_pools_in_place(self):
    # The keys decide what is kept, the values are only read. Compacting in the pool
    # after such a read, XLA copies the value pool; storing from the read entries (what
    # chunked prefill does), it copies nothing. (Eight layers: the pool is larger than
    # a layer's reads.)
    cache = _filled_cache(l=8)
    table, _ = cache.layer_view(1)
    read = [gather_pages(x, table) for x in (cache.k_pages, cache.v_pages, cache.positions,
                                             cache.scores)]
    top = jnp.argsort(-read[0][..., 0], axis=-1)[..., :10].astype(jnp.int32)
    slots = jnp.arange(cache.max_slots)
    mask = (slots == top[..., None]).any(-2) & (slots < cache.lengths[:, 1, :, None])
    want = cache.compact(1, top)
    got = cache.store_kept(1, mask, tuple(read))
    testing.assert_cache_consistent(got)
    np.testing.assert_array_equal(got.kept_positions(), want.kept_positions())

    def program(cache, from_entries):
      table, _ = cache.layer_view(1)
      read = [gather_pages(x, table) for x in (cache.k_pages, cache.v_pages, cache.positions,
                                               cache.scores)]
      top = jnp.argsort(-read[0][..., 0], axis=-1)[..., :10].astype(jnp.int32)
      if from_entries:
        mask = (slots == top[..., None]).any(-2) & (slots < cache.lengths[:, 1, :, None])
        out = cache.store_kept(1, mask, tuple(read))
      else:
        out = cache.compact(1, top)
      return out, read[1].sum()

    def scratch(from_entries):
      fn = jax.jit(functools.partial(program, from_entries=from_entries), donate_argnums=0)
      return fn.lower(cache).compile().memory_analysis().temp_size_in_bytes

    pool = cache.v_pages.nbytes
    self.assertGreaterEqual(scratch(False), pool)
    self.assertLess(scratch(True), pool)

  def test_store_kept_bad_entries(self):
    cache = _filled_cache()
    keep = jnp.zeros((2, 2, 40), bool)
    entries = (jnp.zeros((2, 2, 40, 64)), jnp.zeros((2, 2, 40, 64)),
               jnp.zeros((2, 2, 40), jnp.int32), jnp.zeros((2, 2, 40)))
    with self.assertRaisesRegex(ValueError, r"values must have shape \[B, K, U, H\]"):
      cache.store_kept(1, keep, (entries[0], entries[1][..., :8]) + entries[2:])
    with self.assertRaisesRegex(ValueError, "keep must be a bool array"):
      cache.store_kept(1, keep.astype(jnp.int32), entries)


class GenerationPathTest(parameterized.TestCase):
  """A tiny random model's chunked generate under backend "pallas" (the kernel, in
  Pallas' interpreter) keeps what it keeps under "xla" (the jnp reference), and the
  kernel is what evicts: at every chunk's compression and at decode-time evictions of
  a token (streaming_llm, h2o: one-shot prefill) or of a page (paged_eviction)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import kvjax  # pylint: disable=g-import-not-at-top
    cls.kvjax = kvjax
    cls.lm = kvjax.init_random(kvjax.LlamaConfig(
        vocab_size=97, hidden_size=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, tie_embeddings=False,
        rope_theta=500.0), seed=3)
    rng = np.random.default_rng(0)
    cls.prompts = [rng.integers(0, 97, n).tolist() for n in (90, 41)]

  @parameterized.parameters(("snapkv", dict(window=8)), ("streaming_llm", {}),
                            ("h2o", dict(recent=8)), ("paged_eviction", dict(page_size=8)))
  def test_pallas_keeps_what_xla_keeps(self, name, fields):
    policy = self.kvjax.policies.get(name, **fields)
    kwargs = dict(policy=policy, budget=32, max_new_tokens=24, stop_ids=[], page_size=8,
                  prefill_chunk=32 if policy.chunked_prefill else 0)
    xla = self.kvjax.generate(self.lm, self.prompts, backend="xla", **kwargs)
    with mock.patch.object(backend_lib, "compact_slots",
                           wraps=backend_lib.compact_slots) as kernel:
      pallas = self.kvjax.generate(self.lm, self.prompts, backend="pallas", **kwargs)
    # Traced into the chunk program and, for decode-time evictions, the decode program.
    self.assertGreaterEqual(kernel.call_count,
                            policy.chunked_prefill + policy.evicts_during_decode)
    np.testing.assert_array_equal(np.asarray(pallas.cache.kept_positions()),
                                  np.asarray(xla.cache.kept_positions()))
    self.assertEqual(pallas.token_ids, xla.token_ids)
    testing.assert_cache_consistent(pallas.cache)


class ValidationTest(parameterized.TestCase):

  def _good(self):
    r = jnp.zeros((2,), jnp.int32)
    return dict(pools=(jnp.zeros((4, 8, 16)),), page_table=jnp.zeros((2, 2), jnp.int32),
                lengths=r, new_lengths=r, keep=jnp.zeros((2, 3), jnp.int32), start=r,
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
      ("new_lengths", dict(new_lengths=jnp.zeros((2,), jnp.float32)),
       r"new_lengths must be int32 \[R\] = \(2,\), got float32 \(2,\)"),
      ("start", dict(start=jnp.zeros((2, 1), jnp.int32)),
       r"start must be int32 \[R\] = \(2,\), got int32 \(2, 1\)"),
      ("keep", dict(keep=jnp.zeros((1, 3), jnp.int32)),
       r"keep must be int32 \[R, M\] with R = 2, M >= 1, got int32 \(1, 3\)"),
      ("sources_count", dict(sources=(jnp.zeros((2, 5, 16)),) * 2),
       r"sources must be None or a tuple with one array per pool \(1\)"),
      ("sources_shape", dict(sources=(jnp.zeros((2, 5, 8)),)),
       r"sources\[0\] must have shape \[R, U, H\] = \(2, 5, 16\), got \(2, 5, 8\)"),
  )
  def test_bad_input(self, overrides, message):
    args = {**self._good(), **overrides}
    with self.assertRaisesRegex(ValueError, message):
      compact_slots(**args, interpret=True)
    with self.assertRaisesRegex(ValueError, message):
      compact_slots_reference(**args)


if __name__ == "__main__":
  absltest.main()
