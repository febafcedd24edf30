"""The fused causal attention of a prompt (kvjax.kernels.causal_attention) against
the float32 blockwise reference, and lowered for the chips it is for.

On CPU the XLA form runs as it is and the TPU form (JAX's Pallas flash kernel)
in TPU interpret mode. The cuDNN form needs a GPU to be traced (jax asks the
CUDA plugin for cuDNN's version and the device's compute capability); with
those two answers given, it is lowered for ``cuda`` here, which checks that
jax's cuDNN front end accepts the prompt shapes.
"""

import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src.cudnn import fused_attention_stablehlo
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.kernels import causal_attention as ca

# (N, K, H) of the models whose prompts the kernels see.
SMOLLM2 = (9, 3, 64)
LLAMA_3_2_1B = (32, 8, 64)
# A 2,100-token prompt padded to a multiple of 64: not a power of two, nor a
# multiple of the XLA form's block or of the TPU kernel's largest tile.
PROMPT = 2112


def _inputs(seed, b, t, n, kh, h, dtype):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, n, h))
  k = 2 * rng.standard_normal((b, t, kh, h))  # peaked softmax rows
  v = rng.standard_normal((b, t, kh, h))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _shapes(n, kh, h, t, dtype, b=1):
  return (jax.ShapeDtypeStruct((b, t, n, h), dtype),
          jax.ShapeDtypeStruct((b, t, kh, h), dtype),
          jax.ShapeDtypeStruct((b, t, kh, h), dtype))


def _fresh(f):
  """``f`` under a jit of its own: what a trace reads from the machine (the
  mocks below) is not taken from an earlier test's cached trace."""
  return jax.jit(lambda *args: f(*args))


def _custom_calls(text):
  return set(re.findall(r"custom_call @([\w$.]+)", text))


def _cudnn_traceable():
  """What tracing the cuDNN form asks the machine, answered as an H100/H200 with cuDNN 9.10."""
  stack = [mock.patch.object(fused_attention_stablehlo, "check_cudnn_version",
                             return_value=91000),
           mock.patch.object(fused_attention_stablehlo, "check_compute_capability",
                             return_value=True),
           mock.patch.object(fused_attention_stablehlo, "is_cuda_compute_capability_equal",
                             return_value=False),
           mock.patch.object(ca, "_on_cuda", return_value=True)]
  for patch in stack:
    patch.start()
  return stack


class FusedMatchesReferenceTest(parameterized.TestCase):

  @parameterized.product(
      shape=[(1, 300, *SMOLLM2), (2, 200, 8, 2, 32), (1, 130, 8, 8, 16),
             (2, 150, 8, 1, 64), (1, 40, 4, 2, 16)],
      dtype=[jnp.float32, jnp.bfloat16])
  def test_xla_form(self, shape, dtype):
    # GQA groups 3, 4, 1 and 8; prompts longer than a block and not a multiple
    # of it, and one within a single block (a single call).
    b, t, n, kh, h = shape
    q, k, v = _inputs(t, b, t, n, kh, h, dtype)
    got = jax.jit(lambda q, k, v: ca._xla_query_blocks(q, k, v, block=64))(q, k, v)
    self.assertEqual(got.dtype, dtype)
    testing.assert_close(got, ca.causal_attention_reference(q, k, v), dtype)

  @parameterized.product(
      shape=[(1, 300, *SMOLLM2), (2, 200, 8, 2, 32), (1, 256, 4, 4, 64)],
      dtype=[jnp.float32, jnp.bfloat16])
  def test_tpu_form(self, shape, dtype):
    # Prompts padded inside to a whole tile (300 -> 384, 200 -> 256) and one
    # that fills its tiles.
    b, t, n, kh, h = shape
    q, k, v = _inputs(t + 1, b, t, n, kh, h, dtype)
    with pltpu.force_tpu_interpret_mode():
      self.assertEqual(ca.fused_form(q), ca.TPU_FLASH)
      got = _fresh(ca.causal_attention_fused)(q, k, v)
    self.assertEqual(got.dtype, dtype)
    testing.assert_close(got, ca.causal_attention_reference(q, k, v), dtype)

  @parameterized.parameters(False, True)
  def test_padding_after_a_sequence_does_not_reach_its_queries(self, tpu):
    q, k, v = _inputs(0, 1, 200, 4, 2, 16, jnp.float32)
    # Tokens 150.. pad a 150-token prompt with finite garbage.
    k2, v2 = k.at[:, 150:].set(1e4), v.at[:, 150:].set(-1e4)
    f = jax.jit(lambda q, k, v: ca.causal_attention_fused(q, k, v, block=64))
    if tpu:
      with pltpu.force_tpu_interpret_mode():
        clean, padded = f(q, k, v), f(q, k2, v2)
    else:
      clean, padded = f(q, k, v), f(q, k2, v2)
    np.testing.assert_array_equal(np.asarray(padded)[:, :150], np.asarray(clean)[:, :150])

  def test_first_query_sees_only_the_first_key(self):
    q, k, v = _inputs(2, 2, 100, 6, 2, 16, jnp.float32)
    got = ca.causal_attention_fused(q, k, v, block=32)
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.repeat(np.asarray(v[:, 0]), 3, axis=1),
                               rtol=1e-6)


class FusedFormTest(parameterized.TestCase):

  def test_cuda_takes_cudnn_for_half_precision_and_head_dims_it_supports(self):
    with mock.patch.object(ca, "_on_cuda", return_value=True):
      for dtype, h, want in ((jnp.bfloat16, 64, ca.CUDNN), (jnp.float16, 128, ca.CUDNN),
                             (jnp.float32, 64, ca.XLA), (jnp.bfloat16, 256, ca.XLA),
                             (jnp.bfloat16, 60, ca.XLA)):
        self.assertEqual(ca.fused_form(jnp.zeros((1, 8, 2, h), dtype)), want, (dtype, h))

  def test_cpu_takes_xla(self):
    if jax.default_backend() != "cpu":
      self.skipTest("the default device is not a CPU")
    self.assertEqual(ca.fused_form(jnp.zeros((1, 8, 2, 64), jnp.bfloat16)), ca.XLA)

  def test_cudnn_refusing_while_tracing_falls_back_to_xla(self):
    # cuDNN's front end raises before it adds any op (no cuDNN here at all).
    q, k, v = _inputs(3, 1, 100, 4, 2, 16, jnp.bfloat16)
    with mock.patch.object(ca, "_on_cuda", return_value=True):
      self.assertEqual(ca.fused_form(q), ca.CUDNN)
      got = jax.jit(lambda q, k, v: ca.causal_attention_fused(q, k, v, block=32))(q, k, v)
    testing.assert_close(got, ca.causal_attention_reference(q, k, v), jnp.bfloat16)

  def test_registered_as_the_fused_causal_attention(self):
    fused = backend_lib.implementation("causal_attention", "fused", platform="gpu",
                                       interpret=False)
    self.assertIs(fused.func.__globals__["causal_attention_fused"], ca.causal_attention_fused)
    self.assertEqual(fused.keywords["target"], "gpu")


class LowersForChipsTest(parameterized.TestCase):
  """Lowering only (this machine has neither chip); compiling is the chip's job."""

  @parameterized.product(model=[SMOLLM2, LLAMA_3_2_1B], t=[320, PROMPT])
  def test_cudnn_for_cuda(self, model, t):
    patches = _cudnn_traceable()
    try:
      text = _fresh(ca.causal_attention_fused).trace(
          *_shapes(*model, t, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    finally:
      for patch in patches:
        patch.stop()
    self.assertIn("__cudnn$fmhaSoftmax", _custom_calls(text))

  @parameterized.product(model=[SMOLLM2, LLAMA_3_2_1B], dtype=[jnp.float32, jnp.bfloat16])
  def test_xla_form_for_cuda_and_tpu_holds_no_prompt_square(self, model, dtype):
    # The form float32 prompts take on GPUs: [B, N, block, T] logits at a time.
    xla_form = lambda q, k, v: ca._xla_query_blocks(q, k, v, block=ca.PREFILL_BLOCK)
    for platform in ("cuda", "tpu"):
      text = _fresh(xla_form).trace(
          *_shapes(*model, PROMPT, dtype)).lower(lowering_platforms=(platform,)).as_text()
      self.assertNotRegex(text, rf"\b{PROMPT}x{PROMPT}x")
      self.assertRegex(text, rf"\b{ca.PREFILL_BLOCK}x{PROMPT}x")

  @parameterized.product(model=[SMOLLM2, LLAMA_3_2_1B, (16, 8, 128)], t=[320, PROMPT],
                         dtype=[jnp.float32, jnp.bfloat16])
  def test_tpu_flash_for_tpu(self, model, t, dtype):
    text = _fresh(ca._tpu_flash).trace(*_shapes(*model, t, dtype, b=2)).lower(
        lowering_platforms=("tpu",)).as_text()
    self.assertIn("tpu_custom_call", _custom_calls(text))


if __name__ == "__main__":
  absltest.main()
