r"""Compaction: Pallas kernel (in place) vs jnp reference vs plain XLA, in bytes/s.

  python benchmarks/kernels/bench_compaction.py --rows=12 --page_size=16 --keep=0.5

Each row (a (sequence, KV head)) keeps a random ``keep`` fraction of its slots (the
op's keep-a-set form: the slots in increasing order from slot 0).
Plain XLA: gather every kept entry into freshly allocated dense pools (what one
does without in-place compaction). Bytes: each kept entry's key and value
(and position and score) read once and written once.
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

from kvjax.kernels.compaction import compact_slots
from kvjax.kernels.compaction import compact_slots_reference

flags.DEFINE_integer("rows", 12, "Heads compacted (B * K).")
flags.DEFINE_integer("head_dim", 64, "Head dim H.")
flags.DEFINE_integer("page_size", 16, "Slots per page.")
flags.DEFINE_integer("max_pages", 16, "Pages per head.")
flags.DEFINE_float("keep", 0.5, "Fraction of each head's slots kept.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of keys and values.")
flags.DEFINE_integer("repeats", 3, "Timed calls per implementation.")
FLAGS = flags.FLAGS

_FILLS = (None, None, -1, 0.0)


def main(_):
  r, h, ps, p_max = FLAGS.rows, FLAGS.head_dim, FLAGS.page_size, FLAGS.max_pages
  dtype = jnp.dtype(FLAGS.dtype)
  s = ps * p_max
  num_pages = r * p_max
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.permutation(num_pages).astype(np.int32).reshape(r, p_max))
  lengths = jnp.full((r,), s, jnp.int32)
  n_keep = int(s * FLAGS.keep)
  keep = jnp.asarray(np.sort(np.stack([rng.choice(s, n_keep, replace=False)
                                       for _ in range(r)]), axis=1).astype(np.int32))
  new_lengths, start = jnp.full((r,), n_keep, jnp.int32), jnp.zeros((r,), jnp.int32)
  base = (jnp.asarray(rng.standard_normal((num_pages, ps, h)), dtype),
          jnp.asarray(rng.standard_normal((num_pages, ps, h)), dtype),
          jnp.asarray(rng.integers(0, 1 << 20, (num_pages, ps)), jnp.int32),
          jnp.asarray(rng.random((num_pages, ps)), jnp.float32))
  fresh = lambda: (tuple(jnp.array(x, copy=True) for x in base), table, lengths, new_lengths,
                   keep, start)

  def plain(pools, table, lengths, new_lengths, keep, start):
    del lengths, new_lengths, start
    src = jnp.take_along_axis(table, keep // ps, 1) * ps + keep % ps
    return tuple(x.reshape(num_pages * ps, *x.shape[2:])[src] for x in pools)  # [R, n, ...]

  kernel = jax.jit(lambda *a: compact_slots(*a, fills=_FILLS, interpret=common.interpret()),
                   donate_argnums=0)
  rows = [
      ("kernel (pallas, in place)", common.time_fn(kernel, fresh, repeats=FLAGS.repeats)),
      ("reference (jnp, jit)", common.time_fn(
          jax.jit(lambda *a: compact_slots_reference(*a, fills=_FILLS)), fresh,
          repeats=FLAGS.repeats)),
      ("plain XLA (gather to new)", common.time_fn(jax.jit(plain), fresh,
                                                   repeats=FLAGS.repeats)),
  ]
  per_entry = 2 * h * dtype.itemsize + 4 + 4
  nbytes = 2 * r * n_keep * per_entry
  common.report("compaction", f"R={r} H={h} page={ps} P_max={p_max} keep={FLAGS.keep} "
                f"{dtype.name}", nbytes, rows)


if __name__ == "__main__":
  app.run(main)
