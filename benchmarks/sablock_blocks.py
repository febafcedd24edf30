r"""How much of SABlock's budget goes through whole segments and blocks, on real prompts.

  python benchmarks/sablock_blocks.py --length=4096 --budgets=64,96,128,256,1024

Records the NIAH prompts' forward pass once (every layer's q, k, v), then runs
SABlock's plan on each layer at each budget and counts the entries it keeps
one token at a time (``Plan.single``). The share through blocks is
1 - single / (budget - window), averaged over prompts, layers and KV heads;
the table also gives the worst (layer, KV head).
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.cache.attention import Prompt
from kvjax.generation import inputs
from kvjax.generation import calls
from kvjax.generation.compile import Clock

flags.DEFINE_integer("length", 4096, "Prompt length in tokens.")
flags.DEFINE_list("budgets", ["64", "96", "128", "256", "1024"], "KV entries per KV head.")
flags.DEFINE_list("depths", ["0.1", "0.3", "0.5", "0.7", "0.9"], "Needle depths.")
flags.DEFINE_list("haystacks", ["natural", "repeat"], "Filler kinds.")
FLAGS = flags.FLAGS


def _recorded(lm, ids):
  """Every layer's (q [L, 1, T, N, H], k, v [L, 1, T, K, H]) for one prompt."""
  options = inputs.Options(max_new_tokens=1, page_size=16, pad_multiple=1,
                           attention_block=512, prefill_chunk=0, stop_ids=(), temperature=0.0,
                           top_k=0, seed=0)
  batch = inputs.batch(lm, [ids], None, query_aware=True, chat_template=False, options=options)
  return calls.record(lm, batch, options, Clock()).qkv


def main(_):
  kvjax.runtime.setup()  # as the command-line tools run
  lm = kvjax.load("smollm2-135m-instruct")
  policy = kvjax.policies.get("sablock").bind(lm.tokenizer)
  budgets = [int(b) for b in FLAGS.budgets]
  ex = kvjax.execution.create("xla")
  plans = {b: jax.jit(lambda q, k, v, prompt, b=b: policy.plan(
      ex, policy.score(ex, prompt, q, k, v), prompt, b, b).single) for b in budgets}
  shares = {b: [] for b in budgets}
  for haystack in FLAGS.haystacks:
    for depth in (float(d) for d in FLAGS.depths):
      sample = kvjax.tasks.make_sample(lm.tokenizer, "niah", length=FLAGS.length, depth=depth,
                                       haystack=haystack)
      ids = lm.tokenizer.encode(sample.prompt)
      q_all, k_all, v_all = _recorded(lm, ids)
      t = len(ids)
      prompt = Prompt(jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
                      jnp.asarray([t], jnp.int32))
      for b in budgets:
        for layer in range(lm.config.num_layers):
          single = np.asarray(plans[b](q_all[layer], k_all[layer], v_all[layer], prompt))
          shares[b].append(1.0 - single[0] / (b - policy.window))
  n = len(FLAGS.haystacks) * len(FLAGS.depths)
  print(f"SABlock (window {policy.window}), {FLAGS.length}-token NIAH prompts, n = {n} prompts "
        f"x {lm.config.num_layers} layers x {lm.config.num_kv_heads} KV heads\n")
  print("| budget | free entries | share through segments and blocks | lowest (layer, head) |")
  print("|---|---|---|---|")
  for b in budgets:
    s = np.concatenate(shares[b])
    print(f"| {b} | {b - policy.window} | {100 * s.mean():.1f}% | {100 * s.min():.1f}% |")


if __name__ == "__main__":
  app.run(main)
