r"""Paged decode attention: Pallas kernel vs float32 reference vs plain XLA, in bytes/s.

On CPU the C++ kernel (backend "native") gets a row too.

  python benchmarks/kernels/bench_paged_attention.py --batch=4 --kv_heads=3 --group=3

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
from kvjax.kernels.native import paged_attention_cpu
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference

flags.DEFINE_integer("batch", 4, "Sequences B.")
flags.DEFINE_integer("kv_heads", 3, "KV heads K.")
flags.DEFINE_integer("group", 3, "Query heads per KV head G.")
flags.DEFINE_integer("head_dim", 64, "Head dim H.")
flags.DEFINE_integer("page_size", 16, "Slots per page.")
flags.DEFINE_integer("max_pages", 32, "Pages per head P_max (S = P_max * page_size).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of q, k, v.")
flags.DEFINE_integer("repeats", 5, "Timed calls per implementation.")
FLAGS = flags.FLAGS


def main(_):
  b, kh, g, h = FLAGS.batch, FLAGS.kv_heads, FLAGS.group, FLAGS.head_dim
  ps, p_max = FLAGS.page_size, FLAGS.max_pages
  dtype = jnp.dtype(FLAGS.dtype)
  s = ps * p_max
  rng = np.random.default_rng(0)
  lengths = rng.integers(s // 2, s + 1, (b, kh)).astype(np.int32)
  num_pages = b * kh * p_max
  table = rng.permutation(num_pages).astype(np.int32).reshape(b, kh, p_max)
  q = jnp.asarray(rng.standard_normal((b, kh * g, h)), dtype)
  k_pages = jnp.asarray(rng.standard_normal((num_pages, ps, h)), dtype)
  v_pages = jnp.asarray(rng.standard_normal((num_pages, ps, h)), dtype)
  table, lengths = jnp.asarray(table), jnp.asarray(lengths)
  # The same keys and values, contiguous per sequence: [B, S, K, H].
  k_dense = k_pages[table].reshape(b, kh, s, h).transpose(0, 2, 1, 3)
  v_dense = v_pages[table].reshape(b, kh, s, h).transpose(0, 2, 1, 3)

  def plain(q, k, v, lengths):
    mask = (jnp.arange(s)[None, None, :] < lengths[:, :, None]).repeat(g, axis=1)  # [B, N, S]
    return jax.nn.dot_product_attention(q[:, None], k, v, mask=mask[:, :, None, :])[:, 0]

  kernel = jax.jit(lambda *a: paged_attention(*a, interpret=common.interpret()))
  reference = jax.jit(paged_attention_reference)
  paged_args = lambda: (q, k_pages, v_pages, table, lengths)
  rows = [
      ("kernel (pallas)", common.time_fn(kernel, paged_args, repeats=FLAGS.repeats)),
      ("reference (jnp, jit)", common.time_fn(reference, paged_args, repeats=FLAGS.repeats)),
      ("plain XLA (dense sdpa)", common.time_fn(jax.jit(plain), lambda: (q, k_dense, v_dense,
                                                                        lengths),
                                               repeats=FLAGS.repeats)),
  ]
  if backend_lib.native_available():
    rows.insert(0, ("native (C++, CPU)", common.time_fn(jax.jit(paged_attention_cpu), paged_args,
                                                         repeats=FLAGS.repeats)))
  nbytes = int(lengths.sum()) * h * 2 * dtype.itemsize + 2 * q.nbytes
  common.report("paged decode attention",
                f"B={b} K={kh} G={g} H={h} page={ps} P_max={p_max} {dtype.name}", nbytes, rows)


if __name__ == "__main__":
  app.run(main)
