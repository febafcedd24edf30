"""Paged decode attention lowered for the real chips at the shapes generation uses.

This machine has neither chip: the kernels are lowered, not compiled, for
``cuda`` (the split form, Triton) and ``tpu`` (the pipelined form, Mosaic),
which runs every lowering rule of every op they use. The page tables have the
widths a cache of that capacity gets (a budget's pages plus room for new
tokens is not a power of two) and the pools every layer's pages.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

from kvjax.kernels.paged_attention import _paged_attention
from kvjax.kernels.paged_attention import PagedAttentionBlockSizes
from kvjax.kernels.paged_attention import paged_attention

# name: (B, L, K, G, H, page size, P_max, dtype).
_SHAPES = {
    # SmolLM2-135M: budget 1024 plus a page for the tokens being generated; a full 8K.
    "smollm2_budget_1024": (1, 30, 3, 3, 64, 16, 65, jnp.float32),
    "smollm2_full_8k": (1, 30, 3, 3, 64, 16, 512, jnp.bfloat16),
    # Llama-3.2-1B: full caches of 32K and 128K slots, batch 1 and 8.
    "llama_32k_b1": (1, 16, 8, 4, 64, 16, 2048, jnp.bfloat16),
    "llama_32k_b8": (8, 16, 8, 4, 64, 16, 2048, jnp.bfloat16),
    "llama_128k_b1": (1, 16, 8, 4, 64, 16, 8192, jnp.bfloat16),
    "llama_128k_b8": (8, 16, 8, 4, 64, 16, 8192, jnp.bfloat16),
}
_MARKERS = {"cuda": "triton", "tpu": "tpu_custom_call"}


def _arg_shapes(b, layers, kh, g, h, page_size, p_max, dtype):
  pool = jax.ShapeDtypeStruct((b * layers * kh * p_max, page_size, h), dtype)
  return (jax.ShapeDtypeStruct((b, kh * g, h), dtype), pool, pool,
          jax.ShapeDtypeStruct((b, kh, p_max), jnp.int32),
          jax.ShapeDtypeStruct((b, kh), jnp.int32))


def _lower(fn, shapes, platform):
  return jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()


class LoweringTest(parameterized.TestCase):

  @parameterized.product(shape=sorted(_SHAPES), return_weights=(False, True))
  def test_split_form_lowers_for_cuda(self, shape, return_weights):
    # Off TPU, interpret=False is the GPU (split) form, as on a GPU.
    fn = functools.partial(paged_attention, return_weights=return_weights)
    self.assertIn("triton", _lower(fn, _arg_shapes(*_SHAPES[shape]), "cuda"))

  @parameterized.product(shape=sorted(_SHAPES), return_weights=(False, True))
  def test_pipelined_form_lowers_for_tpu(self, shape, return_weights):
    fn = functools.partial(_paged_attention, block_sizes=None, return_weights=return_weights,
                           interpret=False, fetch="pipelined")
    self.assertIn("tpu_custom_call", _lower(fn, _arg_shapes(*_SHAPES[shape]), "tpu"))

  @parameterized.parameters(("cuda", "split", 2, 4), ("tpu", "pipelined", 2, 1))
  def test_lowers_with_heads_per_block_and_splits(self, platform, fetch, hb, splits):
    fn = functools.partial(_paged_attention, return_weights=True, interpret=False, fetch=fetch,
                           block_sizes=PagedAttentionBlockSizes(4, hb, num_splits=splits))
    shapes = _arg_shapes(2, 1, 4, 4, 128, 16, 40, jnp.bfloat16)
    self.assertIn(_MARKERS[platform], _lower(fn, shapes, platform))

  def test_generation_shapes_default_splits(self):
    # What the default block sizes give the GPU form at these shapes.
    got = {}
    for name, (b, _, kh, _, _, page_size, p_max, _) in _SHAPES.items():
      sizes = PagedAttentionBlockSizes.get_default(page_size, p_max, batch=b, kv_heads=kh,
                                                   form="triton")
      got[name] = (sizes.pages_per_block, sizes.num_splits)
    self.assertEqual(got, {"smollm2_budget_1024": (8, 4), "smollm2_full_8k": (8, 32),
                           "llama_32k_b1": (8, 64), "llama_32k_b8": (8, 8),
                           "llama_128k_b1": (8, 64), "llama_128k_b8": (8, 8)})


class BenchmarkTest(absltest.TestCase):

  def test_runs_on_cpu_in_small_mode(self):
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "kernels",
                          "bench_paged_attention.py")
    proc = subprocess.run(
        [sys.executable, script, "--batch=1", "--kv_heads=2", "--group=2", "--max_pages=4",
         "--repeats=1", "--splits=2"],
        capture_output=True, text=True, timeout=600, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
    for row in ("kernel (split, default)", "kernel (split, splits=2)", "reference (jnp, jit)",
                "plain XLA (dense sdpa)"):
      self.assertIn(row, proc.stdout)


if __name__ == "__main__":
  absltest.main()
