"""Paged decode attention (reference) against dense attention and hand values."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from kvjax import testing
from kvjax.kernels.paged_attention import paged_attention_reference


def _random_paged(rng, *, b, kh, g, h, page_size, p_max, lengths):
  """Dense keys/values [B, K, S, H] scattered into a shuffled page pool."""
  s = p_max * page_size
  keys = rng.standard_normal((b, kh, s, h)).astype(np.float32)
  values = rng.standard_normal((b, kh, s, h)).astype(np.float32)
  q = rng.standard_normal((b, kh * g, h)).astype(np.float32)
  num_pages = b * kh * p_max + 3  # a few pages nobody owns
  order = rng.permutation(num_pages)
  k_pages = rng.standard_normal((num_pages, page_size, h)).astype(np.float32)  # garbage
  v_pages = rng.standard_normal((num_pages, page_size, h)).astype(np.float32)
  table = np.full((b, kh, p_max), -1, np.int32)
  i = 0
  for bi in range(b):
    for ki in range(kh):
      for j in range(-(-lengths[bi, ki] // page_size)):
        page = order[i]
        i += 1
        table[bi, ki, j] = page
        k_pages[page] = keys[bi, ki, j * page_size:(j + 1) * page_size]
        v_pages[page] = values[bi, ki, j * page_size:(j + 1) * page_size]
  return q, keys, values, k_pages, v_pages, table


def _dense_attention(q, keys, values, lengths):
  """float64 numpy attention of q [B, N, H] over keys [B, K, S, H] masked by lengths."""
  b, n, h = q.shape
  kh = keys.shape[1]
  out = np.zeros((b, n, h))
  for bi in range(b):
    for ni in range(n):
      ki = ni // (n // kh)
      length = lengths[bi, ki]
      if length == 0:
        continue
      logits = keys[bi, ki, :length].astype(np.float64) @ q[bi, ni] / np.sqrt(h)
      w = np.exp(logits - logits.max())
      out[bi, ni] = (w / w.sum()) @ values[bi, ki, :length]
  return out


_with_weights = functools.partial(paged_attention_reference, return_weights=True)


class PagedAttentionReferenceTest(chex.TestCase):
  """Hand values; masking both with and without jit (the "xla" backend runs the reference
  inside programs, where XLA may fuse the masked reads)."""

  def test_single_key_returns_its_value(self):
    k_pages = jnp.zeros((2, 4, 2)).at[1, 0].set(jnp.array([1.0, 2.0]))
    v_pages = jnp.zeros((2, 4, 2)).at[1, 0].set(jnp.array([3.0, -4.0]))
    q = jnp.array([[[5.0, 6.0]]])
    out = paged_attention_reference(q, k_pages, v_pages, jnp.array([[[1]]]), jnp.array([[1]]))
    np.testing.assert_allclose(out, [[[3.0, -4.0]]])

  def test_two_keys_by_hand(self):
    # Logits q.k/sqrt(2): k0 = [0, 0] -> 0, k1 = [sqrt(2)*ln 3, 0] with q = [1, 0] -> ln 3,
    # so the weights are 1/4 and 3/4.
    k_pages = jnp.array([[[0.0, 0.0], [np.sqrt(2) * np.log(3.0), 0.0]]])
    v_pages = jnp.array([[[4.0, 0.0], [0.0, 8.0]]])
    out, weights, lse = paged_attention_reference(
        jnp.array([[[1.0, 0.0]]]), k_pages, v_pages, jnp.array([[[0]]]), jnp.array([[2]]),
        return_weights=True)
    np.testing.assert_allclose(weights[0, 0], [0.25, 0.75], rtol=1e-6)
    np.testing.assert_allclose(out[0, 0], [1.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0], np.log(4.0), rtol=1e-6)

  def test_query_heads_read_their_kv_head(self):
    # K = 2, G = 2: query heads 0, 1 read KV head 0 (one slot, value [1, 0]) and query
    # heads 2, 3 read KV head 1 (one slot, value [0, 1]), whatever their queries.
    k_pages = jnp.ones((2, 4, 2))
    v_pages = jnp.zeros((2, 4, 2)).at[0, 0].set(jnp.array([1.0, 0.0])).at[1, 0].set(
        jnp.array([0.0, 1.0]))
    q = jnp.arange(8.0).reshape(1, 4, 2)
    out = paged_attention_reference(q, k_pages, v_pages, jnp.array([[[0], [1]]]),
                                    jnp.array([[1, 1]]))
    np.testing.assert_allclose(out[0], [[1, 0], [1, 0], [0, 1], [0, 1]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_partial_last_page_by_hand(self):
    # Page size 2, three slots over pages 1 and 0 (the last page half full, its second
    # slot holding a huge key that must not count): equal logits, so the mean of the
    # three values.
    k_pages = jnp.zeros((2, 2, 1)).at[0, 1].set(1e4)
    v_pages = jnp.array([[[3.0], [1e6]], [[0.0], [6.0]]])
    out, weights, lse = self.variant(_with_weights)(
        jnp.ones((1, 1, 1)), k_pages, v_pages, jnp.array([[[1, 0]]]), jnp.array([[3]]))
    np.testing.assert_allclose(out[0, 0], [3.0], rtol=1e-6)
    np.testing.assert_allclose(weights[0, 0], [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0], np.log(3.0), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_empty_head_outputs_zeros(self):
    # Its page holds a NaN value, which no slot of a head of length 0 may read.
    v_pages = jnp.ones((1, 8, 4)).at[0, 0, 0].set(jnp.nan)
    out, weights, lse = self.variant(_with_weights)(
        jnp.ones((1, 2, 4)), jnp.ones((1, 8, 4)), v_pages, jnp.array([[[0]]]), jnp.array([[0]]))
    np.testing.assert_array_equal(out, np.zeros((1, 2, 4)))
    np.testing.assert_array_equal(weights, np.zeros((1, 2, 8)))
    np.testing.assert_array_equal(lse, np.full((1, 2), -np.inf))

  @parameterized.product(page_size=(8, 16, 32), group=(1, 3))
  def test_matches_dense_attention(self, page_size, group):
    rng = np.random.default_rng(page_size * 10 + group)
    b, kh, h, p_max = 3, 2, 64, 4
    lengths = np.array([[1, 0], [page_size * 4, page_size + 3], [page_size * 2 - 1, 5]])
    q, keys, values, k_pages, v_pages, table = _random_paged(
        rng, b=b, kh=kh, g=group, h=h, page_size=page_size, p_max=p_max, lengths=lengths)
    out = paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table),
        jnp.asarray(lengths, jnp.int32))
    testing.assert_close(out, _dense_attention(q, keys, values, lengths), jnp.float32)

  def test_jits(self):
    rng = np.random.default_rng(0)
    lengths = np.array([[5, 9]])
    q, keys, values, k_pages, v_pages, table = _random_paged(
        rng, b=1, kh=2, g=3, h=16, page_size=8, p_max=2, lengths=lengths)
    out = jax.jit(paged_attention_reference)(q, k_pages, v_pages, table, lengths)
    testing.assert_close(out, _dense_attention(q, keys, values, lengths), jnp.float32)


if __name__ == "__main__":
  absltest.main()
