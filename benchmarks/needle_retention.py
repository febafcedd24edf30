"""How much of the needle each policy keeps, per layer and KV head: why NIAH cells hit or miss.

For each NIAH prompt and (policy, budget), this compresses the prompt once
(one shared forward per prompt, ``kvjax.generate_each``) and reports, over the
model's (layer, KV head) pairs:

  kept   the mean fraction of the answer's tokens still in the cache;
  whole  the fraction of heads that keep every answer token;
  hit    whether greedy decoding then produced the answer.

A five-digit answer is five or six tokens for SmolLM2; a policy that keeps
some digits in many heads but all of them in none (token-level selection)
loses the number, while block and segment selection keep it whole or not at all.

  python benchmarks/needle_retention.py --length=4096 --budgets=128,256 \
      --out=results/needle_retention
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

import kvjax
from kvjax import policies
from kvjax.eval.retention import answer_span
from kvjax.eval.retention import retention
from kvjax.tasks import niah

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Registry name or path.")
flags.DEFINE_list("policies", ["snapkv", "chunkkv", "paged_eviction", "sablock", "dynsplit_kv"],
                  "Policies to compare.")
flags.DEFINE_list("budgets", ["128", "256"], "KV entries per layer and KV head.")
flags.DEFINE_integer("length", 4096, "Prompt tokens.")
flags.DEFINE_list("depths", ["0.3", "0.7"], "Needle depths.")
flags.DEFINE_list("haystacks", ["natural", "repeat"], "Haystack kinds.")
flags.DEFINE_integer("window", 16, "Observation window of the window-scored policies.")
flags.DEFINE_string("out", "results/needle_retention", "Output folder.")


def main(argv):
  del argv
  kvjax.runtime.setup()  # as the command-line tools run
  lm = kvjax.load(FLAGS.model)
  tok = lm.tokenizer
  runs = [(policies.get(p, **policies.window_fields(p, FLAGS.window)), int(b))
          for p in FLAGS.policies for b in FLAGS.budgets]
  rows = []
  for haystack in FLAGS.haystacks:
    for depth in map(float, FLAGS.depths):
      s = niah.make_sample(tok, "niah", length=FLAGS.length, depth=depth, haystack=haystack,
                           seed=0, index=0)
      span = answer_span(tok, s.context, s.answer)
      results = kvjax.generate_each(lm, [tok.encode(s.context)], runs,
                                    questions=[tok.encode(s.question)],
                                    max_new_tokens=s.max_new_tokens)
      for (policy, budget), r in zip(runs, results):
        kept, whole = retention(r.cache.kept_positions()[0], span)
        rows.append({"haystack": haystack, "depth": depth, "policy": policy.name,
                     "budget": budget, "answer_tokens": len(span), "kept": kept,
                     "whole": whole, "hit": s.answer in r.texts[0], "prediction": r.texts[0]})
        print(json.dumps(rows[-1]), flush=True)
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  lines = [f"# Needle retention, {FLAGS.model}, {FLAGS.length} tokens, window {FLAGS.window}",
           "", "kept: mean fraction of the answer's tokens in the cache over (layer, KV head); "
           "whole: fraction of heads keeping all of them; hit: the answer was generated.", "",
           "| haystack | depth | policy | budget | kept | whole | hit |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['haystack']} | {r['depth']:g} | {r['policy']} | {r['budget']} | "
                 f"{r['kept']:.2f} | {r['whole']:.2f} | {'yes' if r['hit'] else 'no'} |")
  (out / "summary.md").write_text("\n".join(lines) + "\n")
  print(f"wrote {out / 'summary.md'}")


if __name__ == "__main__":
  app.run(main)
