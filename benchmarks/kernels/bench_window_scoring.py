r"""Observation-window scoring: Pallas kernels vs float32 reference vs plain XLA, in bytes/s.

  python benchmarks/kernels/bench_window_scoring.py --tokens=1024 --window=32

Plain XLA: the textbook form (keys repeated to every query head, one softmax
over [B, N, W, T], mean over the window, pooling, group mean). Bytes: the
window queries and every key (read once), the scores written.
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

from kvjax.kernels.window_scoring import avg_pool
from kvjax.kernels.window_scoring import window_scores
from kvjax.kernels.window_scoring import window_scores_reference

flags.DEFINE_integer("batch", 2, "Sequences B.")
flags.DEFINE_integer("tokens", 1024, "Prompt tokens T.")
flags.DEFINE_integer("kv_heads", 3, "KV heads K.")
flags.DEFINE_integer("group", 3, "Query heads per KV head G.")
flags.DEFINE_integer("head_dim", 64, "Head dim H.")
flags.DEFINE_integer("window", 32, "Observation window W.")
flags.DEFINE_integer("pool", 5, "Pooling width.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of q, k.")
flags.DEFINE_integer("repeats", 3, "Timed calls per implementation.")
FLAGS = flags.FLAGS


def main(_):
  b, t, kh, g, h = FLAGS.batch, FLAGS.tokens, FLAGS.kv_heads, FLAGS.group, FLAGS.head_dim
  w, pool = FLAGS.window, FLAGS.pool
  dtype = jnp.dtype(FLAGS.dtype)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, kh * g, h)), dtype)
  k = jnp.asarray(rng.standard_normal((b, t, kh, h)), dtype)
  lengths = jnp.asarray(np.full((b,), t), jnp.int32)
  args = lambda: (q, k, lengths)

  def plain(q, k, lengths):
    del lengths  # every sequence is full here
    qw = q[:, t - w:].astype(jnp.float32)  # [B, W, N, H]
    kr = jnp.repeat(k, g, axis=2).astype(jnp.float32)  # [B, T, N, H]
    logits = jnp.einsum("bwnh,btnh->bnwt", qw, kr) / np.sqrt(h)
    causal = jnp.arange(t)[None, :] <= (t - w + jnp.arange(w))[:, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).mean(2)
    weights = jnp.where(jnp.arange(t) < t - w, weights, 0.0)
    return avg_pool(weights, pool).reshape(b, kh, g, t).mean(2)

  kw = dict(window=w, pool=pool)
  kernel = jax.jit(lambda *a: window_scores(*a, **kw, interpret=common.interpret()))
  rows = [
      ("kernel (pallas)", common.time_fn(kernel, args, repeats=FLAGS.repeats)),
      ("reference (jnp, jit)", common.time_fn(
          jax.jit(lambda *a: window_scores_reference(*a, **kw)), args, repeats=FLAGS.repeats)),
      ("plain XLA (repeat KV heads)", common.time_fn(jax.jit(plain), args,
                                                     repeats=FLAGS.repeats)),
  ]
  nbytes = b * w * kh * g * h * dtype.itemsize + k.nbytes + b * kh * t * 4
  common.report("window scoring", f"B={b} T={t} K={kh} G={g} H={h} W={w} pool={pool} "
                f"{dtype.name}", nbytes, rows)


if __name__ == "__main__":
  app.run(main)
