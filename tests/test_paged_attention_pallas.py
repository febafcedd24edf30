"""Paged decode attention as a Pallas kernel, against the float32 reference.

On CPU the kernel runs in interpret mode: the generic interpreter runs the
looped (GPU-form) kernel; ``force_tpu_interpret_mode`` runs the pipelined
(TPU-form) kernel with scalar prefetch. Both forms are also lowered for their
real platforms (Mosaic TPU, Triton) from this CPU-only machine.
"""

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.experimental.pallas import tpu as pltpu

import kvjax
from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.kernels.paged_attention import _call_looped
from kvjax.kernels.paged_attention import _call_pipelined
from kvjax.kernels.paged_attention import _check_triton_shapes
from kvjax.kernels.paged_attention import _page_fetch
from kvjax.kernels.paged_attention import PagedAttentionBlockSizes
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference


def _paged_inputs(seed, *, b, kh, g, h, page_size, p_max, lengths, dtype):
  """Random q [B, N, H] and a shuffled page pool holding each head's ``lengths`` slots.

  Pages nobody owns and slots past a length hold random garbage; table entries
  past a head's last page are -1.
  """
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths, np.int32)
  num_pages = b * kh * p_max + 3  # a few pages nobody owns
  order = rng.permutation(num_pages)
  table = np.full((b, kh, p_max), -1, np.int32)
  i = 0
  for bi in range(b):
    for ki in range(kh):
      used = -(-lengths[bi, ki] // page_size)
      table[bi, ki, :used] = order[i:i + used]
      i += used
  k_pages = rng.standard_normal((num_pages, page_size, h))
  v_pages = rng.standard_normal((num_pages, page_size, h))
  q = rng.standard_normal((b, kh * g, h))
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table), jnp.asarray(lengths)


def _lengths(b, kh, page_size, p_max):
  """Ragged lengths: an empty head, one slot, a partly filled last page, a full head."""
  pattern = [0, 1, page_size + 3, p_max * page_size, 2 * page_size - 1, page_size]
  return np.resize(pattern, (b, kh)).astype(np.int32)


def _assert_matches_reference(got, want, lengths, dtype, group):
  """out, weights, lse of the kernel vs the reference, on valid positions only."""
  out, weights, lse = got
  want_out, want_weights, want_lse = want
  nonempty = np.repeat(np.asarray(lengths) > 0, group, axis=1)  # [B, N]
  testing.assert_close(out, want_out, dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[~nonempty], 0.0)
  testing.assert_close(lse, want_lse, dtype, mask=nonempty)
  np.testing.assert_array_equal(np.asarray(lse)[~nonempty], -np.inf)
  slots = weights.shape[-1]
  valid = np.repeat(np.arange(slots)[None, None, :] < np.asarray(lengths)[:, :, None], group,
                    axis=1)  # [B, N, S]
  testing.assert_close(weights, want_weights, dtype, mask=valid)
  np.testing.assert_array_equal(np.asarray(weights)[~valid], 0.0)


# (dtype, page_size, group, head_dim, pages_per_block): every value of every axis
# in a few combinations, not the product. None = default block sizes; 3 pages
# per block does not divide P_max = 5, so the table gets padded.
_GRID = (
    (jnp.float32, 8, 1, 64, 2),
    (jnp.float32, 16, 3, 128, None),
    (jnp.float32, 32, 4, 64, 1),
    (jnp.float32, 16, 8, 64, 4),
    (jnp.bfloat16, 8, 8, 128, 4),
    (jnp.bfloat16, 16, 1, 64, 3),
    (jnp.bfloat16, 32, 3, 128, 2),
    (jnp.bfloat16, 8, 4, 64, None),
)


class PagedAttentionKernelTest(parameterized.TestCase):

  @parameterized.parameters(*_GRID)
  def test_matches_reference(self, dtype, page_size, group, head_dim, pages_per_block):
    b, kh, p_max = 3, 2, 5
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(page_size * group + head_dim, b=b, kh=kh, g=group, h=head_dim,
                         page_size=page_size, p_max=p_max, lengths=lengths, dtype=dtype)
    block_sizes = None if pages_per_block is None else PagedAttentionBlockSizes(pages_per_block)
    got = paged_attention(*args, block_sizes=block_sizes, return_weights=True, interpret=True)
    want = paged_attention_reference(*args, return_weights=True)
    self.assertEqual(got[0].dtype, dtype)
    self.assertEqual(got[1].shape, (b, kh * group, p_max * page_size))
    _assert_matches_reference(got, want, lengths, dtype, group)

  def test_without_weights_returns_out_only(self):
    lengths = np.array([[13, 0, 40]], np.int32)
    args = _paged_inputs(0, b=1, kh=3, g=2, h=64, page_size=8, p_max=5, lengths=lengths,
                         dtype=jnp.float32)
    out = paged_attention(*args, interpret=True)
    self.assertIsInstance(out, jax.Array)
    testing.assert_close(out, paged_attention_reference(*args), jnp.float32)

  def test_empty_head(self):
    args = _paged_inputs(1, b=1, kh=1, g=2, h=64, page_size=8, p_max=2, lengths=[[0]],
                         dtype=jnp.float32)
    out, weights, lse = paged_attention(*args, return_weights=True, interpret=True)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(weights, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)

  # Pipelined (TPU) form under TPU interpret mode. Its blocks always satisfy
  # Mosaic's rule, as their last two dims are full: q/out (G, H), a page
  # (S_page, H), lse (G, 1), weight blocks (G, C).
  @parameterized.parameters(
      (jnp.float32, 16, 4, 128, 2),
      (jnp.bfloat16, 32, 8, 128, 2),
  )
  def test_tpu_form_matches_reference(self, dtype, page_size, group, head_dim, pages_per_block):
    b, kh, p_max = 2, 2, 3
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(7, b=b, kh=kh, g=group, h=head_dim, page_size=page_size, p_max=p_max,
                         lengths=lengths, dtype=dtype)
    with pltpu.force_tpu_interpret_mode():
      self.assertEqual(_page_fetch(True), "pipelined")
      got = paged_attention(*args, block_sizes=PagedAttentionBlockSizes(pages_per_block),
                            return_weights=True, interpret=True)
    want = paged_attention_reference(*args, return_weights=True)
    _assert_matches_reference(got, want, lengths, dtype, group)

  # Several KV heads per grid program (kv_heads_per_block), in both forms.
  @parameterized.parameters(
      (jnp.float32, 8, 3, 64, 2, 2, False),
      (jnp.bfloat16, 16, 1, 128, 1, 4, False),
      (jnp.float32, 16, 4, 64, 2, 2, True),
      (jnp.bfloat16, 8, 3, 128, 1, 4, True),
  )
  def test_heads_per_block(self, dtype, page_size, group, head_dim, ppb, hb, tpu_form):
    b, kh, p_max = 2, 4, 3
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(hb * 10 + group, b=b, kh=kh, g=group, h=head_dim, page_size=page_size,
                         p_max=p_max, lengths=lengths, dtype=dtype)
    block_sizes = PagedAttentionBlockSizes(ppb, kv_heads_per_block=hb)
    if tpu_form:
      with pltpu.force_tpu_interpret_mode():
        got = paged_attention(*args, block_sizes=block_sizes, return_weights=True,
                              interpret=True)
    else:
      got = paged_attention(*args, block_sizes=block_sizes, return_weights=True, interpret=True)
    want = paged_attention_reference(*args, return_weights=True)
    _assert_matches_reference(got, want, lengths, dtype, group)

  # The TPU form with the other head dim and group sizes (and default block sizes).
  @parameterized.parameters((jnp.float32, 8, 1, 64), (jnp.bfloat16, 16, 3, 64))
  def test_tpu_form_more_shapes(self, dtype, page_size, group, head_dim):
    b, kh, p_max = 2, 2, 3
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(11, b=b, kh=kh, g=group, h=head_dim, page_size=page_size,
                         p_max=p_max, lengths=lengths, dtype=dtype)
    with pltpu.force_tpu_interpret_mode():
      got = paged_attention(*args, return_weights=True, interpret=True)
    _assert_matches_reference(got, paged_attention_reference(*args, return_weights=True),
                              lengths, dtype, group)

  @parameterized.parameters(("tpu", "pipelined", "tpu_custom_call"),
                            ("cuda", "looped", "triton"))
  def test_lowers_with_heads_per_block(self, platform, form, marker):
    b, kh, g, h, page_size, p_max = 2, 4, 4, 128, 16, 8
    call = {"pipelined": _call_pipelined, "looped": _call_looped}[form]
    fn = functools.partial(call, ppb=2, hb=2, return_weights=True, interpret=False)
    shapes = (jax.ShapeDtypeStruct((b, kh, g, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((80, page_size, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((80, page_size, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, kh, p_max), jnp.int32),
              jax.ShapeDtypeStruct((b, kh), jnp.int32))
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    self.assertIn(marker, text)

  @parameterized.parameters(("tpu", "pipelined", "tpu_custom_call"),
                            ("cuda", "looped", "triton"))
  def test_lowers_for_platform(self, platform, form, marker):
    # Lowering only (this machine has neither chip): the Mosaic and Triton
    # lowering rules accept every op of the kernel; compiling is the chip's job.
    b, kh, g, h, page_size, p_max = 2, 2, 4, 128, 16, 8
    call = {"pipelined": _call_pipelined, "looped": _call_looped}[form]
    fn = functools.partial(call, ppb=4, return_weights=True, interpret=False)
    shapes = (jax.ShapeDtypeStruct((b, kh, g, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((40, page_size, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((40, page_size, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, kh, p_max), jnp.int32),
              jax.ShapeDtypeStruct((b, kh), jnp.int32))
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    self.assertIn(marker, text)

  def test_triton_needs_power_of_two_blocks(self):
    with self.assertRaisesRegex(ValueError, "pages_per_block to be a power of two, got 3"):
      _check_triton_shapes(3, 16, 64)
    with self.assertRaisesRegex(ValueError, r"\(1 \* 8\) and head_dim \(64\) >= 16"):
      _check_triton_shapes(1, 8, 64)

  def test_default_block_sizes(self):
    self.assertEqual(PagedAttentionBlockSizes.get_default(16, 64).pages_per_block, 8)
    self.assertEqual(PagedAttentionBlockSizes.get_default(8, 3).pages_per_block, 2)
    self.assertEqual(PagedAttentionBlockSizes.get_default(256, 4).pages_per_block, 1)


def _good_inputs():
  return dict(q=jnp.zeros((2, 6, 64)), k_pages=jnp.zeros((9, 8, 64)),
              v_pages=jnp.zeros((9, 8, 64)), page_table=jnp.zeros((2, 3, 4), jnp.int32),
              lengths=jnp.zeros((2, 3), jnp.int32))


class PagedAttentionValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("q_rank", dict(q=jnp.zeros((2, 6))), r"q must have rank 3, got shape \(2, 6\)"),
      ("k_rank", dict(k_pages=jnp.zeros((9, 8, 64, 1))),
       r"k_pages must have rank 3, got shape \(9, 8, 64, 1\)"),
      ("table_rank", dict(page_table=jnp.zeros((2, 12), jnp.int32)),
       r"page_table must have rank 3, got shape \(2, 12\)"),
      ("lengths_rank", dict(lengths=jnp.zeros((2,), jnp.int32)),
       r"lengths must have rank 2, got shape \(2,\)"),
      ("q_dtype", dict(q=jnp.zeros((2, 6, 64), jnp.float16)),
       "q must be float32 or bfloat16, got float16"),
      ("kv_dtype", dict(v_pages=jnp.zeros((9, 8, 64), jnp.bfloat16)),
       r"k_pages \(9, 8, 64\) float32 and v_pages \(9, 8, 64\) bfloat16 must match"),
      ("kv_shape", dict(v_pages=jnp.zeros((9, 16, 64))),
       r"k_pages \(9, 8, 64\) float32 and v_pages \(9, 16, 64\) float32 must match"),
      ("head_dim", dict(k_pages=jnp.zeros((9, 8, 32)), v_pages=jnp.zeros((9, 8, 32))),
       r"head dim of q \(64\) and of k_pages/v_pages \(32\) differ"),
      ("batch", dict(page_table=jnp.zeros((3, 3, 4), jnp.int32)),
       "page_table batch 3 != q batch 2"),
      ("group", dict(page_table=jnp.zeros((2, 4, 4), jnp.int32),
                     lengths=jnp.zeros((2, 4), jnp.int32)),
       "query heads N=6 must be a multiple of KV heads K=4"),
      ("table_dtype", dict(page_table=jnp.zeros((2, 3, 4), jnp.int16)),
       "page_table must be int32, got int16"),
      ("lengths_shape", dict(lengths=jnp.zeros((2, 2), jnp.int32)),
       r"lengths must have shape \[B, K\] = \(2, 3\), got \(2, 2\)"),
      ("lengths_dtype", dict(lengths=jnp.zeros((2, 3), jnp.float32)),
       "lengths must be int32, got float32"),
  )
  def test_bad_input(self, overrides, message):
    with self.assertRaisesRegex(ValueError, message):
      paged_attention(**{**_good_inputs(), **overrides}, interpret=True)

  def test_bad_block_sizes_argument(self):
    with self.assertRaisesRegex(ValueError, "block_sizes must be a PagedAttentionBlockSizes"):
      paged_attention(**_good_inputs(), block_sizes=4, interpret=True)

  @parameterized.parameters(0, -2, 2.0, True)
  def test_bad_pages_per_block(self, value):
    with self.assertRaisesRegex(ValueError, "pages_per_block must be a positive int, got"):
      PagedAttentionBlockSizes(value)

  @parameterized.parameters(0, -1, 1.5, False)
  def test_bad_kv_heads_per_block(self, value):
    with self.assertRaisesRegex(ValueError, "kv_heads_per_block must be a positive int, got"):
      PagedAttentionBlockSizes(1, kv_heads_per_block=value)

  def test_kv_heads_per_block_must_divide_k(self):
    with self.assertRaisesRegex(ValueError, "kv_heads_per_block 2 must divide the KV heads K=3"):
      paged_attention(**_good_inputs(), block_sizes=PagedAttentionBlockSizes(1, 2),
                      interpret=True)


class PallasBackendTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.lm = kvjax.init_random(kvjax.LlamaConfig(
        vocab_size=97, hidden_size=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, tie_embeddings=False,
        rope_theta=500.0), seed=3)
    rng = np.random.default_rng(0)
    cls.prompts = [rng.integers(0, 97, n).tolist() for n in (41, 7, 70)]

  def test_registered_and_auto_not_pallas_on_cpu(self):
    self.assertEqual(backend_lib.resolve("pallas"), "pallas")
    # These tests run on CPU: "auto" is the native kernel there, or XLA without it.
    with mock.patch.dict(os.environ, {backend_lib.NATIVE_ENV: "0"}):
      self.assertEqual(backend_lib.resolve("auto"), "xla")

  def test_generate_same_tokens_as_xla(self):
    xla = kvjax.generate(self.lm, self.prompts, max_new_tokens=8, stop_ids=[], backend="xla")
    pallas = kvjax.generate(self.lm, self.prompts, max_new_tokens=8, stop_ids=[],
                            backend="pallas")
    self.assertEqual(pallas.token_ids, xla.token_ids)

  def test_generate_h2o_same_tokens_as_xla(self):
    # H2O accumulates the weights output at every decode step (and evicts by it).
    kwargs = dict(max_new_tokens=8, stop_ids=[], policy="h2o", budget=48)
    xla = kvjax.generate(self.lm, self.prompts, backend="xla", **kwargs)
    pallas = kvjax.generate(self.lm, self.prompts, backend="pallas", **kwargs)
    self.assertEqual(pallas.token_ids, xla.token_ids)
    # Same slots kept, holding the same accumulated attention.
    np.testing.assert_array_equal(pallas.cache.positions, xla.cache.positions)
    testing.assert_close(pallas.cache.scores, xla.cache.scores, jnp.float32)


if __name__ == "__main__":
  absltest.main()
