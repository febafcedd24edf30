"""Paged decode attention as a Pallas kernel, against the float32 reference.

On CPU the kernel runs in interpret mode: the generic interpreter runs the
split (GPU-form, flash-decoding) kernel; ``force_tpu_interpret_mode`` runs the
pipelined (TPU-form) kernel with scalar prefetch, which is also held against
JAX's own TPU paged attention ops. Lowering for the real platforms (Triton,
Mosaic TPU) at generation's shapes is in test_paged_attention_lowering.py.
"""

import functools
import os
import unittest
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.experimental.pallas import tpu as pltpu

import kvjax
from kvjax import backend as backend_lib
from kvjax import testing
from kvjax.kernels import paged_attention_gpu
from kvjax.kernels import platform
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


# (dtype, page_size, group, head_dim, pages_per_block, num_splits,
# return_weights): every value of every axis in a few combinations, not the
# product. None = default block sizes; 3 pages per block does not divide
# P_max = 5, so the table gets padded. A full head's 5 blocks are shared 2/2/1
# by 3 splits, 1/1/1/1/1 (and three empty shares) by 8; shorter heads leave
# some shares empty.
_GRID = (
    (jnp.float32, 8, 1, 64, 2, 2, True),
    (jnp.float32, 16, 3, 128, None, None, False),
    (jnp.float32, 32, 4, 64, 1, 3, True),
    (jnp.float32, 16, 8, 64, 4, 1, False),
    (jnp.bfloat16, 8, 8, 128, 1, 8, True),
    (jnp.bfloat16, 16, 1, 64, 3, 1, True),
    (jnp.bfloat16, 32, 3, 128, 2, 2, False),
    (jnp.bfloat16, 8, 4, 64, 1, 4, False),
)


def _block_sizes(pages_per_block, num_splits=1, kv_heads_per_block=1):
  if pages_per_block is None:
    return None
  return PagedAttentionBlockSizes(pages_per_block, kv_heads_per_block=kv_heads_per_block,
                                  num_splits=num_splits)


class PagedAttentionKernelTest(parameterized.TestCase):

  @parameterized.parameters(*_GRID)
  def test_matches_reference(self, dtype, page_size, group, head_dim, pages_per_block, splits,
                             return_weights):
    b, kh, p_max = 3, 2, 5
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(page_size * group + head_dim, b=b, kh=kh, g=group, h=head_dim,
                         page_size=page_size, p_max=p_max, lengths=lengths, dtype=dtype)
    block_sizes = _block_sizes(pages_per_block, splits)
    self.assertEqual(_page_fetch(True), "split")
    got = paged_attention(*args, block_sizes=block_sizes, return_weights=return_weights,
                          interpret=True)
    want = paged_attention_reference(*args, return_weights=True)
    n, s = kh * group, p_max * page_size
    if not return_weights:
      self.assertIsInstance(got, jax.Array)
      chex.assert_shape(got, (b, n, head_dim))
      chex.assert_type(got, dtype)
      testing.assert_close(got, want[0], dtype)
      return
    # out in q's dtype; weights and lse in float32.
    chex.assert_shape(got, [(b, n, head_dim), (b, n, s), (b, n)])
    chex.assert_type(got, [dtype, jnp.float32, jnp.float32])
    _assert_matches_reference(got, want, lengths, dtype, group)

  def test_without_weights_returns_out_only(self):
    lengths = np.array([[13, 0, 40]], np.int32)
    args = _paged_inputs(0, b=1, kh=3, g=2, h=64, page_size=8, p_max=5, lengths=lengths,
                         dtype=jnp.float32)
    out = paged_attention(*args, interpret=True)
    self.assertIsInstance(out, jax.Array)
    testing.assert_close(out, paged_attention_reference(*args), jnp.float32)

  def test_split_form_writes_weights_only_when_asked(self):
    # The kernel's outputs: the shares' max, sum and output; the block
    # numerators and their maxima only with return_weights.
    args = _paged_inputs(2, b=1, kh=2, g=4, h=64, page_size=16, p_max=8,
                         lengths=[[100, 128]], dtype=jnp.bfloat16)
    q = args[0].reshape(1, 2, 4, 64)

    def kernel_outputs(return_weights):
      fn = functools.partial(paged_attention_gpu.call_split, ppb=2, hb=1, num_splits=4,
                             return_weights=return_weights, interpret=True)
      jaxpr = jax.make_jaxpr(fn)(q, *args[1:])
      calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
      self.assertLen(calls, 1)
      return [v.aval.shape for v in calls[0].outvars]

    self.assertEqual(kernel_outputs(False), [(1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16, 64)])
    self.assertEqual(kernel_outputs(True)[3:], [(1, 2, 4, 16, 32), (1, 2, 4, 16)])

  def test_merge_splits_ignores_empty_shares(self):
    # Share 1 of head 0 is empty (m = -inf, l = 0); head 1 has no slots at all.
    m = jnp.array([[[[1.0], [-jnp.inf], [3.0]], [[-jnp.inf]] * 3]])  # [B=1, K=2, splits=3, G=1]
    l = jnp.array([[[[2.0], [0.0], [1.0]], [[0.0]] * 3]])
    acc = jnp.ones((1, 2, 3, 1, 4)) * l[..., None]
    out, lse = jax.jit(paged_attention_gpu.merge_splits)(m, l, acc)
    total = 2 * np.exp(1.0 - 3.0) + 1.0
    np.testing.assert_allclose(out[0, 0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0], 3.0 + np.log(total), rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_array_equal(lse[0, 1], -np.inf)

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
      (jnp.float32, 8, 3, 64, 2, 2, 2, False),
      (jnp.bfloat16, 16, 1, 128, 1, 4, 3, False),
      (jnp.float32, 16, 4, 64, 2, 2, 1, True),
      (jnp.bfloat16, 8, 3, 128, 1, 4, 1, True),
  )
  def test_heads_per_block(self, dtype, page_size, group, head_dim, ppb, hb, splits, tpu_form):
    b, kh, p_max = 2, 4, 3
    lengths = _lengths(b, kh, page_size, p_max)
    args = _paged_inputs(hb * 10 + group, b=b, kh=kh, g=group, h=head_dim, page_size=page_size,
                         p_max=p_max, lengths=lengths, dtype=dtype)
    block_sizes = _block_sizes(ppb, splits, kv_heads_per_block=hb)
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

  def test_triton_needs_power_of_two_blocks(self):
    check = paged_attention_gpu.check_triton_shapes
    with self.assertRaisesRegex(ValueError, "pages_per_block to be a power of two, got 3"):
      check(pages_per_block=3, page_size=16, head_dim=64, kv_heads_per_block=1)
    with self.assertRaisesRegex(ValueError, "kv_heads_per_block to be a power of two, got 3"):
      check(pages_per_block=2, page_size=16, head_dim=64, kv_heads_per_block=3)
    with self.assertRaisesRegex(ValueError, r"\(1 \* 8\) and head_dim \(64\) >= 16"):
      check(pages_per_block=1, page_size=8, head_dim=64, kv_heads_per_block=1)

  def test_default_block_sizes(self):
    default = PagedAttentionBlockSizes.get_default
    self.assertEqual(default(16, 64), PagedAttentionBlockSizes(8))
    self.assertEqual(default(8, 3).pages_per_block, 2)
    self.assertEqual(default(256, 4).pages_per_block, 1)
    gpu = functools.partial(default, form=platform.GPU)
    # 32K slots in 256 blocks: B * K * splits ~ 4 programs per SM of a 132-SM GPU.
    self.assertEqual(gpu(16, 2048, batch=8, kv_heads=8), PagedAttentionBlockSizes(8, num_splits=8))
    self.assertEqual(gpu(16, 2048, batch=1, kv_heads=8).num_splits, 64)
    # Short heads: at least two blocks per split; B * K filling the chip: one.
    self.assertEqual(gpu(16, 65, batch=1, kv_heads=3).num_splits, 4)
    self.assertEqual(gpu(16, 2048, batch=64, kv_heads=8).num_splits, 1)
    self.assertEqual(gpu(16, 8, batch=1, kv_heads=1).num_splits, 1)


# ---------------------------------------------------------------- JAX's TPU ops


def _jax_layout_inputs(seed, *, b, kh, g, h, page_size, pages_per_seq, lengths, dtype):
  """Inputs in the layout of JAX's TPU paged attention, and the same in ours.

  JAX's: q [B, N, H], k/v pages [K, P, S_page, H], lengths [B], page_indices
  [B, pages_per_seq] (every KV head of a sequence uses the same page ids, in
  its own pool). Ours: head k's pool is pages k * P ... k * P + P - 1 of one
  [K * P, S_page, H] pool.
  """
  rng = np.random.default_rng(seed)
  num_pages = b * pages_per_seq + 2
  cast = lambda x: jnp.asarray(x, dtype)
  q = cast(rng.standard_normal((b, kh * g, h)))
  k_pages = cast(rng.standard_normal((kh, num_pages, page_size, h)))
  v_pages = cast(rng.standard_normal((kh, num_pages, page_size, h)))
  indices = jnp.asarray(rng.permutation(num_pages)[:b * pages_per_seq].reshape(b, -1), jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  table = (jnp.arange(kh, dtype=jnp.int32)[None, :, None] * num_pages + indices[:, None, :])
  ours = (q, k_pages.reshape(-1, page_size, h), v_pages.reshape(-1, page_size, h), table,
          jnp.broadcast_to(lengths[:, None], (b, kh)))
  return (q, k_pages, v_pages, lengths, indices), ours


class JaxTpuOpsTest(parameterized.TestCase):
  """The pipelined (TPU) form and JAX's TPU kernels, on the same inputs in TPU interpret mode.

  JAX's kernels land about 1e-3 from the float32 reference when the TPU
  interpreter runs them, so they are held to bfloat16's tolerance.
  """

  @parameterized.parameters((jnp.float32, 4, 2), (jnp.bfloat16, 8, 1))
  def test_matches_jax_paged_attention(self, dtype, group, pages_per_block):
    from jax.experimental.pallas.ops.tpu import paged_attention as jax_paged  # pylint: disable=g-import-not-at-top
    b, kh, h, page_size = 2, 2, 128, 16
    # JAX's kernel leaves an empty sequence's output unwritten: lengths >= 1.
    lengths = [37, 64]
    theirs_args, ours_args = _jax_layout_inputs(3, b=b, kh=kh, g=group, h=h,
                                                page_size=page_size, pages_per_seq=4,
                                                lengths=lengths, dtype=dtype)
    q, k_pages, v_pages, lengths, indices = theirs_args
    with pltpu.force_tpu_interpret_mode():
      ours = paged_attention(*ours_args, block_sizes=PagedAttentionBlockSizes(pages_per_block),
                             interpret=True)
      # JAX's kernel leaves the 1/sqrt(H) scale to the caller.
      scaled = (q.astype(jnp.float32) * h ** -0.5).astype(dtype)
      theirs = jax_paged.paged_attention(scaled, k_pages, v_pages, lengths, indices,
                                         pages_per_compute_block=pages_per_block)
    testing.assert_close(ours, theirs, jnp.bfloat16)
    testing.assert_close(ours, paged_attention_reference(*ours_args), dtype)

  def _ragged_inputs(self):
    """(their arguments, ours) for ragged paged attention: one query token per sequence."""
    b, kh, g, h, page_size = 2, 2, 4, 128, 16
    theirs_args, ours = _jax_layout_inputs(4, b=b, kh=kh, g=g, h=h, page_size=page_size,
                                           pages_per_seq=4, lengths=[37, 64], dtype=jnp.float32)
    q, k_pages, v_pages, lengths, indices = theirs_args
    # Its pages hold K and V interleaved: [P, S_page, 2K, H], head k's key at 2k.
    kv_pages = jnp.stack([k_pages, v_pages], axis=2)  # [K, P, 2, S_page, H]
    kv_pages = kv_pages.transpose(1, 3, 0, 2, 4).reshape(-1, page_size, 2 * kh, h)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
    return (q, kv_pages, lengths, indices, cu_q_lens, jnp.array([b], jnp.int32)), ours

  def test_matches_jax_ragged_reference(self):
    # JAX's own jnp reference of the ragged op: the layouts map as assumed.
    ragged = _ragged_paged_attention_module()
    theirs_args, ours = self._ragged_inputs()
    theirs = ragged.ref_ragged_paged_attention(*theirs_args, sm_scale=128 ** -0.5)
    testing.assert_close(paged_attention_reference(*ours), theirs, jnp.float32)

  def test_matches_jax_ragged_paged_attention(self):
    ragged = _ragged_paged_attention_module()
    theirs_args, ours_args = self._ragged_inputs()
    with pltpu.force_tpu_interpret_mode():
      try:
        # Block sizes given: its defaults come from a table that needs a TPU.
        theirs = jax.block_until_ready(ragged.ragged_paged_attention(
            *theirs_args, sm_scale=128 ** -0.5, num_kv_pages_per_block=2,
            num_queries_per_block=8))
      except jax.errors.JaxRuntimeError as e:
        if "ReshapeTransform" not in str(e):
          raise
        self.skipTest(f"jax {jax.__version__}'s TPU interpreter cannot run "
                      f"ragged_paged_attention: its kernel reshapes a VMEM ref, which the "
                      f"interpreter does not support (ReshapeTransform)")
      ours = paged_attention(*ours_args, block_sizes=PagedAttentionBlockSizes(2),
                             interpret=True)
    testing.assert_close(ours, theirs, jnp.bfloat16)


def _ragged_paged_attention_module():
  """JAX's ragged paged attention module; the test is skipped where this jax has none."""
  try:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise unittest.SkipTest(f"jax {jax.__version__} has no ragged_paged_attention") from None
  return kernel


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

  @parameterized.parameters(0, -3, 2.5, True)
  def test_bad_num_splits(self, value):
    with self.assertRaisesRegex(ValueError, "num_splits must be a positive int, got"):
      PagedAttentionBlockSizes(1, num_splits=value)

  def test_tpu_form_takes_one_split(self):
    with pltpu.force_tpu_interpret_mode():
      with self.assertRaisesRegex(ValueError, "num_splits must be 1, got 4"):
        paged_attention(**_good_inputs(), block_sizes=PagedAttentionBlockSizes(1, num_splits=4),
                        interpret=True)

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
