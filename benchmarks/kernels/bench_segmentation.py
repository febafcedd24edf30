r"""Segmentation: Pallas kernels vs jnp references vs plain XLA, in bytes/s.

  python benchmarks/kernels/bench_segmentation.py --batch=4 --tokens=4096

Two ops: segment ids from delimiter cuts (SABlock) and the importance-aware
boundary walk (DynSplit-KV). Plain XLA for segment ids is a cumsum of the cuts
(no length limits); for the walk, fixed-size chunks (what DynSplit-KV
replaces). Bytes: the inputs read and the outputs written once.
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

from kvjax.kernels import segmentation

flags.DEFINE_integer("batch", 4, "Sequences B.")
flags.DEFINE_integer("tokens", 4096, "Tokens T per sequence.")
flags.DEFINE_float("delimiters", 0.08, "Fraction of tokens that end a clause.")
flags.DEFINE_integer("max_segment", 64, "SABlock's longest segment.")
flags.DEFINE_integer("min_segment", 4, "SABlock's shortest segment.")
flags.DEFINE_integer("chunk", 16, "DynSplit-KV's C.")
flags.DEFINE_integer("delta", 4, "DynSplit-KV's delta.")
flags.DEFINE_integer("repeats", 3, "Timed calls per implementation.")
FLAGS = flags.FLAGS


def main(_):
  b, t = FLAGS.batch, FLAGS.tokens
  rng = np.random.default_rng(0)
  cut = jnp.asarray(rng.random((b, t)) < FLAGS.delimiters)
  lengths = jnp.asarray(rng.integers(t // 2, t + 1, b).astype(np.int32))
  density = jnp.asarray(rng.random((b, t)).astype(np.float32))
  seg = dict(max_segment=FLAGS.max_segment, min_segment=FLAGS.min_segment)
  split = dict(chunk=FLAGS.chunk, delta=FLAGS.delta, alpha=1.0)
  interpret = common.interpret()
  seg_rows = [
      ("kernel (pallas)", common.time_fn(
          lambda c, n: segmentation.segment_ids(c, n, interpret=interpret, **seg),
          lambda: (cut, lengths), repeats=FLAGS.repeats)),
      ("reference (jnp, jit)", common.time_fn(
          jax.jit(lambda c, n: segmentation.segment_ids_reference(c, n, **seg)),
          lambda: (cut, lengths), repeats=FLAGS.repeats)),
      ("plain XLA (cumsum of cuts)", common.time_fn(
          jax.jit(lambda c, n: jnp.cumsum(c, axis=1, dtype=jnp.int32)),
          lambda: (cut, lengths), repeats=FLAGS.repeats)),
  ]
  common.report("segment ids", f"B={b} T={t}", b * t * (1 + 4), seg_rows)
  nb = segmentation.max_blocks(t, FLAGS.chunk, FLAGS.delta)
  split_rows = [
      ("kernel (pallas)", common.time_fn(
          lambda d, c, n: segmentation.dynamic_split(d, c, n, interpret=interpret, **split),
          lambda: (density, cut, lengths), repeats=FLAGS.repeats)),
      ("reference (jnp, jit)", common.time_fn(
          jax.jit(lambda d, c, n: segmentation.dynamic_split_reference(d, c, n, **split)),
          lambda: (density, cut, lengths), repeats=FLAGS.repeats)),
      ("plain XLA (fixed chunks)", common.time_fn(
          jax.jit(lambda d, c, n: jnp.mean(d.reshape(b, -1, FLAGS.chunk), axis=-1)),
          lambda: (density, cut, lengths), repeats=FLAGS.repeats)),
  ]
  common.report("dynamic split", f"B={b} T={t} C={FLAGS.chunk} delta={FLAGS.delta}",
                b * t * (4 + 1) + 2 * b * nb * 4, split_rows)


if __name__ == "__main__":
  app.run(main)
