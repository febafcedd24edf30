"""The C++ causal attention of a prompt (kvjax.kernels.native) against the float32
reference and float64 softmax, and in generation (its sanitizer check:
tests/test_native_sanitizers.py)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.cache import attention
from kvjax.kernels import native
from kvjax.kernels.causal_attention import causal_attention_reference


def setUpModule():
  if not backend_lib.native_available():
    raise AssertionError(f"native kernels unavailable: {backend_lib._native_error()}")


def _dense_float64(q, k, v):
  b, t, n, h = q.shape
  kh = k.shape[2]
  logits = np.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kh, n // kh, h).astype(np.float64),
                     k.astype(np.float64)) / np.sqrt(h)
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bkgts,bskh->btkgh", w, v.astype(np.float64)).reshape(b, t, n, h)


class NativeCausalAttentionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("smollm2_like", (1, 300, 9, 3, 64)),
      ("batch_and_short", (2, 5, 4, 2, 32)),
      ("one_kv_head", (1, 130, 8, 1, 16)),
      ("head_dim_not_16", (2, 77, 6, 3, 40)),  # values padded to a whole tile
      ("mha_long_blocks", (1, 400, 2, 2, 64)),  # G = 1: 64-token query blocks
      ("many_groups", (1, 50, 32, 2, 8)),  # G = 16: 12-token query blocks
  )
  def test_matches_reference_and_float64(self, shape):
    b, t, n, kh, h = shape
    rng = np.random.default_rng(t)
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = (2 * rng.standard_normal((b, t, kh, h))).astype(np.float32)  # peaked softmax rows
    v = rng.standard_normal((b, t, kh, h)).astype(np.float32)
    got = np.asarray(jax.jit(native.causal_attention_cpu)(q, k, v))
    np.testing.assert_allclose(got, np.asarray(causal_attention_reference(q, k, v)),
                               atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(got, _dense_float64(q, k, v), atol=2e-6, rtol=1e-5)
    # The first query sees only key 0: its output is value 0, for every head of the group.
    np.testing.assert_allclose(got[:, 0], np.repeat(v[:, 0], n // kh, axis=1), rtol=1e-6)

  def test_padding_after_a_sequence_does_not_reach_its_queries(self):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 70, s, 16)).astype(np.float32) for s in (4, 2, 2))
    k2, v2 = k.copy(), v.copy()
    # Tokens 50.. pad a 50-token prompt with finite garbage (a padded prompt's
    # forward gives finite values; as in the reference, a weight of 0 does not
    # cancel a NaN).
    k2[:, 50:], v2[:, 50:] = 1e30, -1e30
    f = jax.jit(native.causal_attention_cpu)
    np.testing.assert_array_equal(np.asarray(f(q, k2, v2))[:, :50], np.asarray(f(q, k, v))[:, :50])

  def test_other_dtypes_run_the_reference(self):
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    got = native.causal_attention_cpu(q, q[:, :, :1], q[:, :, :1], block=4)
    self.assertEqual(got.dtype, jnp.bfloat16)
    testing.assert_close(got, causal_attention_reference(q, q[:, :, :1], q[:, :, :1]),
                         jnp.bfloat16)

  def test_entry_point_follows_the_backend(self):
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((1, 40, s, 16)), jnp.float32) for s in (2, 1))
    with backend_lib.use("native"):
      native_out = jax.jit(attention.causal_attention)(q, k, k)
    with backend_lib.use("xla"):
      xla_out = jax.jit(attention.causal_attention)(q, k, k)
    testing.assert_close(native_out, xla_out)
    with backend_lib.use("native"):
      text = jax.jit(attention.causal_attention).lower(q, k, k).as_text()
    self.assertIn("kvjax_causal_attention_cpu", text)

  def test_bad_shapes_raise(self):
    q = np.zeros((1, 8, 3, 16), np.float32)
    with self.assertRaises(Exception):  # 3 query heads over 2 KV heads
      jax.jit(native.causal_attention_cpu)(q, q[:, :, :2], q[:, :, :2]).block_until_ready()


if __name__ == "__main__":
  absltest.main()
