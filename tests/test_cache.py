"""PagedKVCache: allocation, writes, appends, capacity and the attention entry points."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.cache import EMPTY
from kvjax.cache import PagedKVCache
from kvjax.cache import attention


def _cache(**kw):
  args = dict(batch_size=2, capacity=32, num_layers=2, num_kv_heads=3, head_dim=4, page_size=8)
  args.update(kw)
  return PagedKVCache.create(**args)


def _owned_pages(cache):
  table = np.asarray(cache.page_table)
  return table[table >= 0]


class CreateTest(absltest.TestCase):

  def test_pool_holds_exactly_the_capacity(self):
    cache = _cache()
    self.assertEqual(cache.num_pages, 2 * 2 * 3 * 32 // 8)
    self.assertEqual(cache.kv_bytes, 2 * cache.num_pages * 8 * 4 * 4)
    self.assertEqual(int(cache.num_free), cache.num_pages)

  def test_per_layer_and_per_head_capacity_shrinks_the_pool(self):
    uniform = _cache(capacity=32)
    per_layer = _cache(capacity=[32, 16])
    per_head = _cache(capacity=[[32, 16, 8], [8, 8, 8]])
    self.assertEqual(per_layer.num_pages, 2 * 3 * (4 + 2))
    self.assertEqual(per_head.num_pages, 2 * (4 + 2 + 1 + 3))
    self.assertLess(per_head.kv_bytes, per_layer.kv_bytes)
    self.assertLess(per_layer.kv_bytes, uniform.kv_bytes)

  def test_bad_capacity(self):
    with self.assertRaisesRegex(ValueError, "multiple of page_size 8"):
      _cache(capacity=20)
    with self.assertRaisesRegex(ValueError, "3 layers, the model has 2"):
      _cache(capacity=[8, 8, 8])
    with self.assertRaisesRegex(ValueError, "page_size must be a positive int"):
      _cache(page_size=0)


class ReserveReleaseTest(absltest.TestCase):

  def test_reserve_gives_distinct_pages_and_keeps_the_count(self):
    cache = _cache()
    cache = cache.reserve(jnp.full((2, 2, 3), 9))  # 2 pages per head
    owned = _owned_pages(cache)
    self.assertLen(owned, 2 * 2 * 3 * 2)
    self.assertLen(set(owned.tolist()), len(owned))
    free = np.asarray(cache.free_pages)[:int(cache.num_free)]
    self.assertEmpty(set(free.tolist()) & set(owned.tolist()))
    self.assertEqual(len(owned) + int(cache.num_free), cache.num_pages)

  def test_reserve_is_idempotent_and_capped_at_capacity(self):
    cache = _cache().reserve(jnp.full((2, 2, 3), 9))
    again = cache.reserve(jnp.full((2, 2, 3), 16))
    np.testing.assert_array_equal(again.page_table, cache.page_table)
    full = cache.reserve(jnp.full((2, 2, 3), 1000))
    self.assertEqual(int(full.num_free), 0)
    self.assertTrue(np.all(np.asarray(full.page_table) >= 0))

  def test_release_returns_pages(self):
    cache = _cache().reserve(jnp.full((2, 2, 3), 8))
    page = int(cache.page_table[0, 1, 2, 0])
    released = cache.release(jnp.array([page, -1]))
    self.assertEqual(int(released.num_free), int(cache.num_free) + 1)
    self.assertEqual(int(released.free_pages[int(released.num_free) - 1]), page)


class WriteTest(absltest.TestCase):

  def test_write_and_kept_positions(self):
    cache = _cache(batch_size=1, num_kv_heads=2, capacity=16)
    t = 5
    k = jnp.arange(t * 2 * 4, dtype=jnp.float32).reshape(1, t, 2, 4)
    v = -k
    positions = jnp.arange(10, 10 + t)[None]
    # head 0 keeps tokens 1 and 3, head 1 keeps every token.
    slots = jnp.array([[[-1, 0, -1, 1, -1], [0, 1, 2, 3, 4]]])
    cache = cache.reserve(jnp.array([[[2, 5], [0, 0]]]))
    cache = cache.write(0, k, v, slots, positions)
    cache = cache.set_lengths(0, jnp.array([[2, 5]]))
    kept = np.asarray(cache.kept_positions())
    np.testing.assert_array_equal(kept[0, 0, 0, :3], [11, 13, EMPTY])
    np.testing.assert_array_equal(kept[0, 0, 1, :6], [10, 11, 12, 13, 14, EMPTY])
    self.assertTrue(np.all(kept[0, 1] == EMPTY))
    page = int(cache.page_table[0, 0, 0, 0])
    np.testing.assert_array_equal(cache.k_pages[page, 1], k[0, 3, 0])
    np.testing.assert_array_equal(cache.v_pages[page, 0], v[0, 1, 0])

  def test_append_fills_then_drops_at_capacity(self):
    cache = _cache(batch_size=1, num_layers=1, num_kv_heads=1, capacity=8)
    for i in range(10):
      cache = cache.reserve(cache.lengths + 1)
      kv = jnp.full((1, 1, 1, 4), float(i))
      cache = cache.append(0, kv, kv, jnp.array([[i]]))
    self.assertEqual(int(cache.lengths[0, 0, 0]), 8)
    np.testing.assert_array_equal(cache.kept_positions()[0, 0, 0], np.arange(8))

  def test_open_token_slots_equals_reserve_and_append(self):
    # Heads empty, mid-page, on a page boundary, one short of capacity and at it,
    # in two sequences, appended for a few steps: the same cache either way.
    cache = _cache(capacity=[[16, 16, 8], [16, 8, 16]], page_size=4)
    lengths = jnp.array([[[0, 3, 8], [4, 7, 5]], [[16, 15, 1], [8, 8, 12]]], jnp.int32)
    cache = cache.reserve(lengths).replace(lengths=lengths)
    for step in range(5):
      kv = jax.random.normal(jax.random.key(step), (2, 2, 1, 3, 4))
      pos = jnp.array([20 + step, 40 + step], jnp.int32)
      old = cache.reserve(cache.lengths + 1)
      for layer in range(2):
        old = old.append(layer, kv[layer], -kv[layer], pos[:, None])
      new, slots = cache.open_token_slots(pos)
      for layer in range(2):
        new = new.write_token(layer, kv[layer], -kv[layer], slots[:, layer])
      testing.assert_cache_consistent(new)
      jax.tree.map(np.testing.assert_array_equal, new, old)
      cache = new


def _appended(lengths, page_size=4):
  """A cache (B=1, L=2, K=2) whose head (l, k) holds positions 0 .. lengths[l][k] - 1
  in order, its keys and values equal to its positions."""
  cache = _cache(batch_size=1, num_kv_heads=2, page_size=page_size, capacity=4 * page_size)
  t = int(np.max(lengths))
  kv = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None, None], (1, t, 2, 4))
  for layer, row in enumerate(lengths):
    n = jnp.asarray([row], jnp.int32)  # [B, K]
    cache = cache.set_lengths(layer, n)
    cache = cache.reserve(cache.lengths)
    slots = jnp.where(jnp.arange(t) < n[..., None], jnp.arange(t), -1)
    cache = cache.write(layer, kv, kv, slots, jnp.arange(t, dtype=jnp.int32)[None])
  return cache


class EvictionTest(parameterized.TestCase):
  """Evictions (``remove``, ``drop_pages``, ``compact``) through the backend's
  ``compact_slots`` op: the same cache from the kernel ("pallas") as from its reference."""

  def test_remove_moves_the_last_slot_in_and_frees_an_emptied_page(self):
    cache = _appended([[9, 6], [3, 4]])
    free = int(cache.num_free)
    # (0, 0): slot 2 takes slot 8, page 2 (slot 8 alone) is freed; (0, 1): slot 5 is
    # the last one; (1, 0): -1; (1, 1): slot 4 is past the length.
    out = cache.remove(jnp.array([[[2, 5], [-1, 4]]], jnp.int32))
    testing.assert_cache_consistent(out)
    kept = np.asarray(out.kept_positions())[0]
    np.testing.assert_array_equal(kept[0, 0, :9], [0, 1, 8, 3, 4, 5, 6, 7, EMPTY])
    np.testing.assert_array_equal(kept[0, 1, :6], [0, 1, 2, 3, 4, EMPTY])
    np.testing.assert_array_equal(out.lengths[0], [[8, 5], [3, 4]])
    self.assertEqual(int(out.num_free), free + 1)
    np.testing.assert_array_equal(out.page_table[0, 1], cache.page_table[0, 1])
    page = int(out.page_table[0, 0, 0, 0])
    np.testing.assert_array_equal(out.k_pages[page, 2], np.full(4, 8.0))

  @parameterized.parameters("remove", "drop_pages", "compact")
  def test_pallas_equals_xla(self, method):
    cache = _appended([[9, 6], [13, 4]])
    args = {"remove": jnp.array([[[2, 5], [0, 4]]], jnp.int32),
            "drop_pages": jnp.array([[[1, 0], [2, -1]]], jnp.int32),
            "compact": (1, jnp.array([[[3, 0, 12, 7, 3], [-1, 2, 1, 3, 9]]], jnp.int32))}[method]
    args = args if isinstance(args, tuple) else (args,)
    outs = []
    for backend in ("xla", "pallas"):
      with backend_lib.use(backend):
        outs.append(jax.jit(lambda c, *a: getattr(c, method)(*a))(cache, *args))
    testing.assert_cache_consistent(outs[0])
    for got, want in zip(jax.tree.leaves(outs[1]), jax.tree.leaves(outs[0])):
      np.testing.assert_array_equal(got, want)


class AttentionEntryPointTest(absltest.TestCase):

  def test_causal_attention_equals_dense_softmax(self):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 37, 6, 8))
    k = rng.standard_normal((2, 37, 2, 8))
    v = rng.standard_normal((2, 37, 2, 8))
    logits = np.einsum("btkgh,bskh->bkgts", q.reshape(2, 37, 2, 3, 8), k) / np.sqrt(8)
    logits = np.where(np.tril(np.ones((37, 37), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    dense = np.einsum("bkgts,bskh->btkgh", weights, v).reshape(2, 37, 6, 8)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    for block in (8, 16, 64):  # partial last block, several blocks, one block
      testing.assert_close(attention.causal_attention(q, k, v, block=block), dense)
    full = attention.causal_attention(q, k, v)
    # Hand check of the first query: it sees only key 0, so it returns value 0.
    np.testing.assert_allclose(full[:, 0, :3], jnp.broadcast_to(v[:, 0, :1], (2, 3, 8)),
                               rtol=1e-6)

  def test_prefill_then_decode_equals_dense_attention(self):
    rng = np.random.default_rng(1)
    b, t, n, kh, h = 2, 20, 6, 2, 8
    lengths = jnp.array([20, 13])
    q = jnp.asarray(rng.standard_normal((b, t + 1, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t + 1, kh, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t + 1, kh, h)), jnp.float32)
    cache = PagedKVCache.create(batch_size=b, capacity=32, num_layers=1, num_kv_heads=kh,
                                head_dim=h, page_size=8)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = cache.reserve(jnp.broadcast_to(lengths[:, None, None], (b, 1, kh)))
    cache, _ = attention.prefill_attention(cache, 0, q[:, :t], k[:, :t], v[:, :t], positions,
                                           lengths)
    np.testing.assert_array_equal(cache.lengths[:, 0], [[20, 20], [13, 13]])
    # Decode the token at index `length` of each sequence.
    idx = lengths[:, None, None, None]
    take = lambda x: jnp.take_along_axis(x, jnp.broadcast_to(idx, (b, 1) + x.shape[2:]), 1)
    cache = cache.reserve(cache.lengths + 1)
    cache, out = attention.decode_attention(cache, 0, take(q), take(k), take(v),
                                            lengths[:, None])
    # Dense: sequence 1's token 13 attends to tokens 0..13 after moving it to slot 13.
    k_dense = jnp.concatenate([k[:, :13], take(k)], axis=1)
    v_dense = jnp.concatenate([v[:, :13], take(v)], axis=1)
    expected1 = attention.causal_attention(
        jnp.concatenate([q[:, :13], take(q)], axis=1), k_dense, v_dense)[1, 13]
    expected0 = attention.causal_attention(q, k, v)[0, 20]
    testing.assert_close(out[0, 0], expected0)
    testing.assert_close(out[1, 0], expected1)


if __name__ == "__main__":
  absltest.main()
