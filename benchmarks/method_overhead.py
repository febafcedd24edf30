r"""What SABlock's and DynSplit-KV's own stages cost, as a fraction of prefill time.

  python benchmarks/method_overhead.py --lengths=4096,8000

Both methods score tokens with SnapKV's window attention (shared with SnapKV);
what they add is segmentation and the block search (SABlock) or the boundary
walk and block selection (DynSplit-KV). This times exactly that stage, jitted,
on the real prompt's tokens with window scores from random queries and keys,
once per layer, and compares it with the full-cache prefill of the same prompt
in the same run (warm-up first; best of --repeats; block_until_ready).
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.cache.attention import Prompt

flags.DEFINE_list("lengths", ["4096", "8000"], "Prompt lengths in tokens.")
flags.DEFINE_integer("budget", 1024, "KV entries per (layer, KV head).")
flags.DEFINE_integer("repeats", 3, "Timed runs (the best counts).")
FLAGS = flags.FLAGS


def _best(fn, repeats):
  jax.block_until_ready(fn())  # warm-up: compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def main(_):
  kvjax.runtime.setup()  # as the command-line tools run
  lm = kvjax.load("smollm2-135m-instruct")
  cfg = lm.config
  print(f"{'length':>7} {'prefill s':>10} {'method':>12} {'stage ms/layer':>15} "
        f"{'x layers ms':>12} {'of prefill':>11}")
  for length in (int(x) for x in FLAGS.lengths):
    sample = kvjax.tasks.make_sample(lm.tokenizer, "niah", length=length, haystack="natural")
    ids = lm.tokenizer.encode(sample.prompt)
    prefill = min(kvjax.generate(lm, [ids], max_new_tokens=1).stats.prefill_s
                  for _ in range(FLAGS.repeats + 1))  # the first run compiles (excluded)
    t = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    prompt = Prompt(tokens, jnp.arange(t, dtype=jnp.int32)[None], jnp.asarray([t], jnp.int32))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    ex = kvjax.execution.create("xla")
    for name in ("sablock", "dynsplit_kv"):
      policy = kvjax.policies.get(name).bind(lm.tokenizer)
      scores, density = policy.scorer.prefix_scores(ex, q, k, prompt.lengths)
      if name == "sablock":
        stage = jax.jit(lambda s, d: policy.plan(ex, s, prompt, FLAGS.budget, FLAGS.budget).keep)
      else:
        stage = jax.jit(lambda s, d: policy.plan_from_scores(
            ex, s, d, prompt, FLAGS.budget, FLAGS.budget).keep)
      seconds = _best(lambda: stage(scores, density), FLAGS.repeats)
      total = seconds * cfg.num_layers
      print(f"{t:>7} {prefill:>10.2f} {name:>12} {1e3 * seconds:>15.2f} {1e3 * total:>12.1f} "
            f"{100 * total / prefill:>10.2f}%", flush=True)


if __name__ == "__main__":
  app.run(main)
