"""Observation-window scoring: the reference against hand values, the Pallas kernels
(interpret mode: generic and TPU forms) against the reference, lowering for TPU and
GPU, input validation, and the backend switch that SnapKV-family policies go through.
"""

import functools
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.experimental.pallas import tpu as pltpu

from kvjax import backend as backend_lib
from kvjax import execution
from kvjax import testing
from kvjax.kernels import platform
from kvjax.kernels.window_scoring import WindowScoringBlockSizes
from kvjax.kernels.window_scoring import token_norms
from kvjax.kernels.window_scoring import token_norms_reference
from kvjax.kernels.window_scoring import window_scores
from kvjax.kernels.window_scoring import window_scores_reference
from kvjax.policies import scoring


def _inputs(seed, *, b, t, kh, g, h, dtype):
  rng = np.random.default_rng(seed)
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(rng.standard_normal((b, t, kh * g, h))), cast(rng.standard_normal((b, t, kh, h))),
          cast(rng.standard_normal((b, t, kh, h))))


class ReferenceByHandTest(absltest.TestCase):

  def test_one_query_three_keys(self):
    # H = 1 (scale 1), window 1: the query at position 2 (q = 1) sees keys 0, ln 2, 0:
    # weights 1/4, 1/2, 1/4. Key 2 is the window itself, so it scores 0.
    q = jnp.array([0.0, 0.0, 1.0]).reshape(1, 3, 1, 1)
    k = jnp.array([0.0, np.log(2.0), 0.0]).reshape(1, 3, 1, 1)
    scores = window_scores_reference(q, k, jnp.array([3], jnp.int32), window=1)
    np.testing.assert_allclose(scores, [[[0.25, 0.5, 0.0]]], rtol=1e-6)

  def test_window_average_and_padding(self):
    # window 2 over length 3 (T = 4, one padding token). Row at position 1 sees keys 0, 1
    # (equal logits: 1/2 each); row at position 2 sees keys 0, 1, 2 (1/3 each). Key 0 is the
    # only prefix key: (1/2 + 1/3) / 2 = 5/12. Keys 1, 2 are the window, key 3 is padding.
    q = jnp.zeros((1, 4, 1, 2))
    k = jnp.ones((1, 4, 1, 2))
    scores = window_scores_reference(q, k, jnp.array([3], jnp.int32), window=2)
    np.testing.assert_allclose(scores, [[[5 / 12, 0.0, 0.0, 0.0]]], rtol=1e-6)

  def test_group_mean_and_max(self):
    # Two query heads share one KV head; window 1, the row at position 2 sees keys
    # k = 0, 1, 0 (H = 1): head 0 (q = 0) weighs them 1/3 each, head 1 (q = ln 3)
    # 1/5, 3/5, 1/5. Keys 0 and 1 are the prefix.
    q = jnp.zeros((1, 3, 2, 1)).at[0, 2, 1, 0].set(np.log(3.0))
    k = jnp.array([0.0, 1.0, 0.0]).reshape(1, 3, 1, 1)
    lengths = jnp.array([3], jnp.int32)
    mean = window_scores_reference(q, k, lengths, window=1, group="mean")
    mx = window_scores_reference(q, k, lengths, window=1, group="max")
    np.testing.assert_allclose(mean[0, 0, :2], [(1 / 3 + 1 / 5) / 2, (1 / 3 + 3 / 5) / 2],
                               rtol=1e-6)
    np.testing.assert_allclose(mx[0, 0, :2], [1 / 3, 3 / 5], rtol=1e-6)

  def test_pooling(self):
    np.testing.assert_allclose(scoring.avg_pool(jnp.arange(1.0, 6.0), 3),
                               [1.0, 2.0, 3.0, 4.0, 3.0], rtol=1e-6)

  def test_norms(self):
    k = jnp.array([3.0, 4.0, 0.0, 1.0]).reshape(1, 2, 1, 2)
    np.testing.assert_allclose(token_norms_reference(k), [[[5.0, 1.0]]])
    _, kn, vn = window_scores_reference(jnp.zeros((1, 2, 1, 2)), k, jnp.array([2], jnp.int32),
                                        window=1, v=2 * k, return_norms=True)
    np.testing.assert_allclose(kn, [[[5.0, 1.0]]])
    np.testing.assert_allclose(vn, [[[10.0, 2.0]]])

  def test_short_and_empty_sequences_score_zero(self):
    q, k, _ = _inputs(0, b=2, t=16, kh=1, g=2, h=8, dtype=jnp.float32)
    scores = window_scores_reference(q, k, jnp.array([0, 3], jnp.int32), window=4)
    np.testing.assert_array_equal(scores, 0.0)


# (dtype, group, head_dim, block_keys, pool, group reduction): every value of every axis
# in a few combinations. Lengths are ragged: empty, shorter than the window, a partial
# last block, full.
_GRID = (
    (jnp.float32, 1, 64, 16, 1, "mean"),
    (jnp.float32, 3, 128, 32, 5, "mean"),
    (jnp.float32, 4, 64, None, 5, "max"),
    (jnp.float32, 8, 64, 32, 1, "max"),
    (jnp.bfloat16, 8, 128, 16, 5, "mean"),
    (jnp.bfloat16, 1, 64, 32, 3, "max"),
    (jnp.bfloat16, 3, 64, 16, 1, "mean"),
    (jnp.bfloat16, 4, 128, None, 5, "mean"),
)


def _assert_matches(got, want, dtype):
  for a, w in zip(got, want):
    testing.assert_close(a, w, dtype)


class WindowScoresKernelTest(parameterized.TestCase):

  @parameterized.parameters(*_GRID)
  def test_matches_reference(self, dtype, group, head_dim, block_keys, pool, how):
    b, t, kh, window = 4, 70, 2, 8
    q, k, v = _inputs(group * head_dim, b=b, t=t, kh=kh, g=group, h=head_dim, dtype=dtype)
    lengths = jnp.array([0, 5, 37, 70], jnp.int32)
    bs = None if block_keys is None else WindowScoringBlockSizes(block_keys)
    kwargs = dict(window=window, pool=pool, group=how, v=v, return_norms=True)
    got = window_scores(q, k, lengths, block_sizes=bs, interpret=True, **kwargs)
    want = window_scores_reference(q, k, lengths, **kwargs)
    chex.assert_shape(got, (b, kh, t))  # scores, key norms, value norms
    chex.assert_type(got, jnp.float32)
    _assert_matches(got, want, dtype)

  def test_scores_only_and_window_longer_than_prompt(self):
    q, k, _ = _inputs(1, b=2, t=24, kh=1, g=2, h=64, dtype=jnp.float32)
    lengths = jnp.array([24, 10], jnp.int32)
    got = window_scores(q, k, lengths, window=32, interpret=True)
    self.assertIsInstance(got, jax.Array)
    testing.assert_close(got, window_scores_reference(q, k, lengths, window=32))

  def test_token_norms(self):
    _, k, _ = _inputs(2, b=2, t=40, kh=3, g=1, h=64, dtype=jnp.bfloat16)
    testing.assert_close(token_norms(k, block_sizes=WindowScoringBlockSizes(16), interpret=True),
                         token_norms_reference(k), jnp.bfloat16)

  # The TPU form under TPU interpret mode, with Mosaic-legal blocks: 128 keys, or one
  # block covering the padded prompt.
  @parameterized.parameters((jnp.float32, 3, 128, 128, 5, "max"),
                            (jnp.bfloat16, 4, 64, None, 5, "mean"))
  def test_tpu_form_matches_reference(self, dtype, group, head_dim, block_keys, pool, how):
    q, k, v = _inputs(3, b=2, t=200, kh=2, g=group, h=head_dim, dtype=dtype)
    lengths = jnp.array([200, 77], jnp.int32)
    bs = None if block_keys is None else WindowScoringBlockSizes(block_keys)
    kwargs = dict(window=16, pool=pool, group=how, v=v, return_norms=True)
    with pltpu.force_tpu_interpret_mode():
      self.assertEqual(platform.lowering(True), platform.TPU)
      got = window_scores(q, k, lengths, block_sizes=bs, interpret=True, **kwargs)
      norms = token_norms(k, interpret=True)
    _assert_matches(got, window_scores_reference(q, k, lengths, **kwargs), dtype)
    testing.assert_close(norms, token_norms_reference(k), dtype)

  def test_tpu_form_rejects_unaligned_blocks(self):
    q, k, _ = _inputs(4, b=1, t=64, kh=1, g=1, h=64, dtype=jnp.float32)
    with pltpu.force_tpu_interpret_mode():
      with self.assertRaisesRegex(ValueError, r"block_keys \(32\) to be a multiple of 128"):
        window_scores(q, k, jnp.array([64], jnp.int32), window=8,
                      block_sizes=WindowScoringBlockSizes(32), interpret=True)

  @parameterized.parameters(("tpu", platform.TPU, "tpu_custom_call"),
                            ("cuda", platform.GPU, "triton"))
  def test_lowers_for_platform(self, plat, form, marker):
    # Lowering only (no chip here): the Mosaic and Triton lowering rules accept every op.
    b, t, kh, g, h = 2, 1024, 2, 4, 128
    shapes = (jax.ShapeDtypeStruct((b, t, kh * g, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((b,), jnp.int32))
    for how in ("mean", "max"):
      fn = functools.partial(window_scores.__wrapped__, window=32, pool=5, group=how,
                             return_norms=True, block_sizes=WindowScoringBlockSizes(256))
      with mock.patch.object(platform, "lowering", lambda interpret, target=None: form):
        lowered = jax.jit(lambda q, k, l: fn(q, k, l, v=k)).trace(*shapes).lower(
            lowering_platforms=(plat,))
      self.assertIn(marker, lowered.as_text())


def _good():
  return dict(q=jnp.zeros((2, 16, 6, 64)), k=jnp.zeros((2, 16, 3, 64)),
              lengths=jnp.zeros((2,), jnp.int32))


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("q_rank", dict(q=jnp.zeros((2, 16, 64))), r"q must have rank 4 \[B, T, N, H\]"),
      ("k_rank", dict(k=jnp.zeros((2, 16, 64))), r"k must have rank 4 \[B, T, K, H\]"),
      ("shared", dict(q=jnp.zeros((2, 8, 6, 64))),
       r"q \(2, 8, 6, 64\) and k \(2, 16, 3, 64\) must share B, T and H"),
      ("group", dict(q=jnp.zeros((2, 16, 4, 64))),
       "query heads N=4 must be a multiple of KV heads K=3"),
      ("dtype", dict(k=jnp.zeros((2, 16, 3, 64), jnp.float16)),
       "k must be float32 or bfloat16, got float16"),
      ("v_shape", dict(v=jnp.zeros((2, 16, 3, 32))), r"v \(2, 16, 3, 32\) must have k's shape"),
      ("lengths_shape", dict(lengths=jnp.zeros((3,), jnp.int32)),
       r"lengths must have shape \[B\] = \(2,\), got \(3,\)"),
      ("lengths_dtype", dict(lengths=jnp.zeros((2,), jnp.float32)),
       "lengths must be int32, got float32"),
      ("window", dict(window=0), "window must be a positive int, got 0"),
      ("pool", dict(pool=4), "pool must be an odd positive int, got 4"),
      ("group_how", dict(group="sum"), r"group must be one of \('mean', 'max'\), got 'sum'"),
      ("block_sizes", dict(block_sizes=64), "block_sizes must be a WindowScoringBlockSizes"),
  )
  def test_bad_input(self, overrides, message):
    args = {"window": 4, **_good(), **overrides}
    with self.assertRaisesRegex(ValueError, message):
      window_scores(**args, interpret=True)

  @parameterized.parameters(0, 12, -8, 16.0, True)
  def test_bad_block_keys(self, value):
    with self.assertRaisesRegex(ValueError, "block_keys must be a positive multiple of 8"):
      WindowScoringBlockSizes(value)

  def test_default_block_sizes(self):
    self.assertEqual(WindowScoringBlockSizes.get_default(40).block_keys, 64)
    self.assertEqual(WindowScoringBlockSizes.get_default(5).block_keys, 16)
    self.assertEqual(WindowScoringBlockSizes.get_default(5000).block_keys, 512)
    self.assertEqual(WindowScoringBlockSizes.get_default(5000, platform.GPU).block_keys, 64)


class BackendTest(absltest.TestCase):

  def test_every_op_resolves_on_every_backend(self):
    # The ops of packed weights and a prompt's attention have no Pallas kernel:
    # a forced "pallas" runs their XLA form.
    no_pallas = {"causal_attention", "quantized_matmul", "dequantize"}
    for op in backend_lib.ops():
      self.assertEqual(backend_lib.resolve("pallas", op), "xla" if op in no_pallas else "pallas")
      self.assertEqual(backend_lib.resolve("xla", op), "xla")
      # These tests run on CPU: "auto" is native where the op has a C++ kernel.
      on_cpu = "native" if "native" in backend_lib._OPS[op] else "xla"
      self.assertEqual(backend_lib.resolve("auto", op), on_cpu)

  def test_unknown_names(self):
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      backend_lib.resolve("triton")
    with self.assertRaisesRegex(ValueError, "unknown kernel op 'nope'"):
      backend_lib.resolve("xla", "nope")
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      with backend_lib.use("cuda"):
        pass

  def test_ambient_backend(self):
    self.assertEqual(backend_lib.current(), "xla")
    with backend_lib.use("pallas"):
      self.assertEqual(backend_lib.current(), "pallas")
      self.assertIs(backend_lib.get("window_scores").func,
                    backend_lib._OPS["window_scores"]["pallas"])
      self.assertEqual(execution.ambient().choice("window_scores"), "pallas")
    self.assertEqual(backend_lib.current(), "xla")
    self.assertIs(backend_lib.get("window_scores"), window_scores_reference)

  def test_policy_scores_through_the_pallas_kernel(self):
    q, k, _ = _inputs(5, b=2, t=48, kh=3, g=3, h=64, dtype=jnp.float32)
    lengths = jnp.array([48, 30], jnp.int32)
    xla, ex = execution.create("xla"), execution.create("pallas")
    norms_xla = scoring.key_norm_scores(xla, k)
    xla = scoring.snapkv_scores(xla, q, k, lengths, window=8, kernel=5)
    with mock.patch.object(backend_lib, "window_scores", wraps=window_scores) as spy:
      pallas = scoring.snapkv_scores(ex, q, k, lengths, window=8, kernel=5)
    norms_pallas = scoring.key_norm_scores(ex, k)
    spy.assert_called_once()
    finite = np.isfinite(np.asarray(xla))
    np.testing.assert_array_equal(finite, np.isfinite(np.asarray(pallas)))
    testing.assert_close(pallas, xla, mask=finite)
    testing.assert_close(norms_pallas, norms_xla)


if __name__ == "__main__":
  absltest.main()
