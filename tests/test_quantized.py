"""Packed GGUF blocks (kvjax.kernels.quantized): the references against gguf's own
dequantisation, the native kernels against the references, and packed models."""


from absl.testing import absltest
from absl.testing import parameterized
import chex
import gguf
import pytest
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax.kernels import native
from kvjax.kernels import quantized

_TYPES = {"Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def setUpModule():
  if not backend_lib.native_available():
    raise AssertionError(f"native kernels unavailable: {backend_lib._native_error()}")


def _packed(seed, fmt, d_out, d_in, scale=0.05):
  """Random float weights quantized by gguf: (packed [D_out, R] uint8, gguf's dequantized [D_out, D_in])."""
  rng = np.random.default_rng(seed)
  w = (scale * rng.standard_normal((d_out, d_in))).astype(np.float32)
  packed = gguf.quants.quantize(w, _TYPES[fmt]).astype(np.uint8)
  return packed, gguf.quants.dequantize(packed, _TYPES[fmt]).astype(np.float32)


class FormatTest(parameterized.TestCase):

  def test_widths_name_the_format(self):
    self.assertIs(quantized.block_format(576 // 32 * 20, 576), quantized.Q4_1)
    self.assertIs(quantized.block_format(576 // 32 * 34, 576), quantized.Q8_0)
    with self.assertRaisesRegex(ValueError, "no known format"):
      quantized.block_format(100, 576)
    with self.assertRaisesRegex(ValueError, "not a multiple"):
      quantized.block_format(20, 33)

  @parameterized.parameters("Q4_1", "Q8_0")
  def test_reference_matches_gguf_bit_for_bit(self, fmt):
    packed, want = _packed(0, fmt, 48, 96)
    got = quantized.dequantize_reference(jnp.asarray(packed), 96)
    np.testing.assert_array_equal(np.asarray(got), want)

  def test_worked_q4_1_block(self):
    # d = 0.5, m = -1, nibbles 0..15 low and 15..0 high: w[j] = 0.5 q - 1.
    block = np.zeros(20, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    block[4:] = np.arange(16) | ((15 - np.arange(16)) << 4)
    got = np.asarray(quantized.dequantize_reference(jnp.asarray(block[None]), 32))[0]
    np.testing.assert_array_equal(got[:16], 0.5 * np.arange(16) - 1)
    np.testing.assert_array_equal(got[16:], 0.5 * (15 - np.arange(16)) - 1)

  def test_worked_q8_0_block(self):
    block = np.zeros(34, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    block[2:] = np.arange(-16, 16).astype(np.int8).view(np.uint8)
    got = np.asarray(quantized.dequantize_reference(jnp.asarray(block[None]), 32))[0]
    np.testing.assert_array_equal(got, 0.25 * np.arange(-16, 16))


class NativeTest(parameterized.TestCase):

  @parameterized.product(fmt=["Q4_1", "Q8_0"], rows=[1, 3, 4, 7, 16, 17, 40],
                         shape=[(576, 192), (64, 1536), (32, 5)])
  def test_matmul_matches_reference(self, fmt, rows, shape):
    d_in, d_out = shape
    packed, dense = _packed(rows, fmt, d_out, d_in)
    x = np.random.default_rng(1).standard_normal((rows, d_in)).astype(np.float32)
    got = np.asarray(jax.jit(native.quantized_matmul_cpu)(x, packed))
    want = np.asarray(quantized.quantized_matmul_reference(x, packed))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, x.astype(np.float64) @ dense.T.astype(np.float64),
                               rtol=2e-5, atol=2e-5)

  def test_leading_axes(self):
    packed, _ = _packed(0, "Q4_1", 96, 64)
    x = np.random.default_rng(2).standard_normal((2, 1, 64)).astype(np.float32)
    got = jax.jit(native.quantized_matmul_cpu)(x, packed)
    chex.assert_shape(got, (2, 1, 96))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, quantized.quantized_matmul_reference(x, packed),
                               rtol=2e-5, atol=2e-5)

  @parameterized.product(fmt=["Q4_1", "Q8_0"], transpose=[False, True])
  def test_dequantize_matches_gguf_bit_for_bit(self, fmt, transpose):
    packed, want = _packed(3, fmt, 130, 96)  # rows not a multiple of a part
    got = np.asarray(jax.jit(native.dequantize_cpu, static_argnums=1,
                             static_argnames="transpose")(packed, 96, transpose=transpose))
    np.testing.assert_array_equal(got, want.T if transpose else want)

  def test_subnormal_and_special_scales(self):
    # Scales that are f16 subnormals, zero and negative convert as numpy's f16 does.
    packed, _ = _packed(4, "Q8_0", 6, 32)
    scales = np.array([6e-8, 3e-5, 0.0, -0.0, -2.5, 65504.0], np.float16)
    packed[:, 0:2] = scales.view(np.uint8).reshape(6, 2)
    want = quantized.dequantize_reference(jnp.asarray(packed), 32)
    got = jax.jit(native.dequantize_cpu, static_argnums=1)(packed, 32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_bad_shapes_raise(self):
    packed, _ = _packed(0, "Q4_1", 8, 64)
    with self.assertRaisesRegex(ValueError, "no known format"):
      native.quantized_matmul_cpu(np.zeros((1, 96), np.float32), packed)


if __name__ == "__main__":
  absltest.main()


# ------------------------------------------------------------------ packed models


@pytest.fixture(scope="module")
def smollm2_packed(smollm2_path):
  import kvjax
  return kvjax.load(smollm2_path, packed=True)


def test_packed_weights_are_the_float_weights_bit_for_bit(smollm2_lm, smollm2_packed):
  from kvjax.models import lm as lm_lib
  floats = lm_lib.canonical_weights(smollm2_lm)
  packed = lm_lib.canonical_weights(smollm2_packed)
  assert set(floats) == set(packed)
  kinds = set()
  for name, w in packed.items():
    if w.dtype != np.uint8:
      np.testing.assert_array_equal(w, floats[name])
      continue
    d_in = floats[name].shape[-1] if name == "embed" else floats[name].shape[-2]
    kinds.add(quantized.block_format(w.shape[-1], d_in).name)
    values = np.asarray(quantized.dequantize_reference(jnp.asarray(w), d_in))
    want = floats[name] if name == "embed" else np.swapaxes(floats[name], -1, -2)
    np.testing.assert_array_equal(values, want, err_msg=name)
  assert kinds == {"Q4_1", "Q8_0"}  # the layers' matrices and the tied embedding
  float_bytes = sum(x.nbytes for x in jax.tree.leaves(smollm2_lm.params))
  packed_bytes = sum(x.nbytes for x in jax.tree.leaves(smollm2_packed.params))
  assert smollm2_packed.packed and not smollm2_lm.packed
  assert packed_bytes < float_bytes / 5, (packed_bytes, float_bytes)


def test_packed_model_gives_the_float_models_logits_and_tokens(smollm2_lm, smollm2_packed):
  import kvjax
  ids = smollm2_lm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
  np.testing.assert_allclose(np.asarray(smollm2_packed.forward([ids])),
                             np.asarray(smollm2_lm.forward([ids])), atol=2e-3, rtol=1e-4)
  kwargs = dict(policy="streaming_llm", budget=24, max_new_tokens=12, stop_ids=[])
  want = kvjax.generate(smollm2_lm, [ids * 3], **kwargs).token_ids
  assert kvjax.generate(smollm2_packed, [ids * 3], **kwargs).token_ids == want
  assert kvjax.generate(smollm2_packed, [ids * 3], backend="xla", **kwargs).token_ids == want


def test_packed_unrolled_layers(smollm2_path, smollm2_packed):
  import kvjax
  unrolled = kvjax.load(smollm2_path, packed=True, scan_layers=False)
  assert not unrolled.scan_layers and unrolled.packed
  ids = [[1, 2, 3, 4, 5, 6]]
  np.testing.assert_allclose(np.asarray(unrolled.forward(ids)),
                             np.asarray(smollm2_packed.forward(ids)), atol=1e-4, rtol=1e-5)
