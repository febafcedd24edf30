r"""Paged decode attention: Pallas kernel vs float32 reference vs plain XLA, in bytes/s.

On a GPU or TPU the default (``--preset=auto``) measures the accelerator
shapes: the Llama-3.2-1B layout (K=8 KV heads, G=4, H=64, pages of 16) with
32K slots per head, bfloat16, at batch 8 and batch 1. On CPU it measures the
shape the flags give (small by default; the kernel is interpreted there, so
its figure measures Pallas' interpreter) and the C++ kernel (backend
"native") gets a row too.

  python benchmarks/kernels/bench_paged_attention.py                 # auto
  python benchmarks/kernels/bench_paged_attention.py --splits=1,8,32,128
  python benchmarks/kernels/bench_paged_attention.py --preset=flags --batch=4 \
      --kv_heads=3 --group=3 --max_pages=64

``--splits`` adds a kernel row per split count (GPU form), beside the default.
Plain XLA: jax.nn.dot_product_attention over a contiguous [B, S, K, H] cache
masked by length (no pages). Bytes: the keys and values of the filled slots,
plus the queries and outputs.
"""

import os
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top

from kvjax import backend as backend_lib
from kvjax.bench.accelerator.scales import FULL
from kvjax.kernels.native import paged_attention_cpu
from kvjax.kernels.paged_attention import _page_fetch
from kvjax.kernels.paged_attention import PagedAttentionBlockSizes
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference

flags.DEFINE_enum("preset", "auto", ["auto", "accelerator", "flags"],
                  "accelerator: B=8 and B=1 at K=8 G=4 H=64, 32K slots, bfloat16; flags: the "
                  "shape below; auto: accelerator on GPU/TPU, flags on CPU.")
flags.DEFINE_integer("batch", 4, "Sequences B.")
flags.DEFINE_integer("kv_heads", 3, "KV heads K.")
flags.DEFINE_integer("group", 3, "Query heads per KV head G.")
flags.DEFINE_integer("head_dim", 64, "Head dim H.")
flags.DEFINE_integer("page_size", 16, "Slots per page.")
flags.DEFINE_integer("max_pages", 32, "Pages per head P_max (S = P_max * page_size).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of q, k, v.")
flags.DEFINE_list("splits", [], "Extra kernel rows with these num_splits (GPU form).")
flags.DEFINE_integer("repeats", 5, "Timed calls per implementation.")
FLAGS = flags.FLAGS

# (B, K, G, H, page size, P_max, dtype): the accelerator preset's kernel shapes.
_ACCELERATOR_SHAPES = tuple((b, kh, g, h, FULL.page_size, s // FULL.page_size, FULL.dtype)
                            for b, kh, g, h, s in FULL.kernel_shapes)


def _inputs(b, kh, g, h, ps, p_max, dtype):
  """Random q, a shuffled pool, its page table and lengths in [S/2, S]."""
  s = ps * p_max
  rng = np.random.default_rng(0)
  lengths = rng.integers(s // 2, s + 1, (b, kh)).astype(np.int32)
  num_pages = b * kh * p_max
  table = rng.permutation(num_pages).astype(np.int32).reshape(b, kh, p_max)
  key = jax.random.key(0)
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (b, kh * g, h), dtype)
  k_pages = jax.random.normal(kk, (num_pages, ps, h), dtype)
  v_pages = jax.random.normal(kv, (num_pages, ps, h), dtype)
  return q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(lengths)


def _kernel_rows(args, interpret):
  """The kernel with default block sizes, then with each ``--splits`` count."""
  p_max = args[3].shape[2]
  ppb = PagedAttentionBlockSizes.get_default(args[1].shape[1], p_max).pages_per_block
  configs = [("default", None)] + [
      (f"splits={n}", PagedAttentionBlockSizes(ppb, num_splits=int(n))) for n in FLAGS.splits]
  rows = []
  for name, block_sizes in configs:
    fn = jax.jit(lambda *a, bs=block_sizes: paged_attention(*a, block_sizes=bs,
                                                            interpret=interpret))
    rows.append((f"kernel ({_page_fetch(interpret)}, {name})",
                 common.time_fn(fn, lambda: args, repeats=FLAGS.repeats)))
  return rows


def _measure(b, kh, g, h, ps, p_max, dtype):
  """Times every implementation at one shape and prints its bytes/s."""
  dtype = jnp.dtype(dtype)
  s = ps * p_max
  args = _inputs(b, kh, g, h, ps, p_max, dtype)
  q, k_pages, v_pages, table, lengths = args
  # The same keys and values, contiguous per sequence: [B, S, K, H].
  k_dense = k_pages[table].reshape(b, kh, s, h).transpose(0, 2, 1, 3)
  v_dense = v_pages[table].reshape(b, kh, s, h).transpose(0, 2, 1, 3)

  def plain(q, k, v, lengths):
    mask = (jnp.arange(s)[None, None, :] < lengths[:, :, None]).repeat(g, axis=1)  # [B, N, S]
    return jax.nn.dot_product_attention(q[:, None], k, v, mask=mask[:, :, None, :])[:, 0]

  rows = _kernel_rows(args, common.interpret())
  rows += [
      ("reference (jnp, jit)", common.time_fn(jax.jit(paged_attention_reference), lambda: args,
                                              repeats=FLAGS.repeats)),
      ("plain XLA (dense sdpa)", common.time_fn(jax.jit(plain),
                                                lambda: (q, k_dense, v_dense, lengths),
                                                repeats=FLAGS.repeats)),
  ]
  if backend_lib.native_available():
    rows.insert(0, ("native (C++, CPU)", common.time_fn(jax.jit(paged_attention_cpu),
                                                         lambda: args, repeats=FLAGS.repeats)))
  nbytes = int(lengths.sum()) * h * 2 * dtype.itemsize + 2 * q.nbytes
  common.report("paged decode attention",
                f"B={b} K={kh} G={g} H={h} page={ps} P_max={p_max} {dtype.name}", nbytes, rows)


def main(_):
  preset = FLAGS.preset
  if preset == "auto":
    preset = "flags" if jax.default_backend() == "cpu" else "accelerator"
  if preset == "accelerator":
    for shape in _ACCELERATOR_SHAPES:
      _measure(*shape)
  else:
    _measure(FLAGS.batch, FLAGS.kv_heads, FLAGS.group, FLAGS.head_dim, FLAGS.page_size,
             FLAGS.max_pages, FLAGS.dtype)


if __name__ == "__main__":
  app.run(main)
