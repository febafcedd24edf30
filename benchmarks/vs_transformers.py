r"""Full-cache generation speed: kvjax next to transformers' own generate, in one run.

  python benchmarks/vs_transformers.py --lengths=1024,4096 --new_tokens=64

Both sides: SmolLM2-135M-Instruct from the same GGUF, float32, batch 1, greedy,
the same passkey prompt ids. kvjax's compile time is excluded (its programs
are compiled before timing; a second call is timed). transformers runs with
SDPA attention and one warm-up call. Writes a JSON row per (side, length).
"""

import json
import os
import pathlib
import time

from absl import app
from absl import flags

import peers  # this folder: transformers' loading

flags.DEFINE_list("lengths", ["1024", "4096"], "Prompt lengths in tokens.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated (no early stop).")
flags.DEFINE_integer("repeats", 2, "Timed runs per side and length; the best is kept.")
flags.DEFINE_string("out", "results/vs_transformers.jsonl", "Where to write the JSON rows.")
FLAGS = flags.FLAGS


def _kvjax_run(lm, ids, n):
  import kvjax
  best = None
  for _ in range(FLAGS.repeats + 1):  # the first call compiles
    s = kvjax.generate(lm, [ids], max_new_tokens=n, stop_ids=[]).stats
    if best is None or s.prefill_s + s.decode_s < best.prefill_s + best.decode_s:
      best = s
  return dict(prefill_s=best.prefill_s, decode_tokens_per_s=(n - 1) / best.decode_s,
              kv_bytes=best.kv_bytes)


def _hf_run(model, ids, n):
  import torch
  x = torch.tensor([ids])
  mask = torch.ones_like(x)
  config = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
  with torch.no_grad():
    model.generate(x[:, :32], attention_mask=mask[:, :32], **config)  # warm-up
    best = None
    for _ in range(FLAGS.repeats):
      start = time.perf_counter()
      out = model(x, attention_mask=mask, use_cache=True)
      prefill = time.perf_counter() - start
      start = time.perf_counter()
      model.generate(x, attention_mask=mask, **config)
      total = time.perf_counter() - start
      # generate = one prefill + (n - 1) decode steps.
      row = dict(prefill_s=prefill, decode_tokens_per_s=(n - 1) / max(total - prefill, 1e-9))
      if best is None or row["prefill_s"] < best["prefill_s"]:
        best = row
      del out
  return best


def main(argv):
  del argv
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from kvjax import runtime
  runtime.setup()  # as the command-line tools run
  import jax
  import torch

  import kvjax
  from kvjax import tasks
  lm = kvjax.load()
  hf = peers.load_transformers(lm.source)
  rows = []
  for length in map(int, FLAGS.lengths):
    prompt = tasks.passkey_prompt(lm.tokenizer, context_tokens=length, seed=0).prompt
    ids = lm.tokenizer.encode(prompt)
    ours = _kvjax_run(lm, ids, FLAGS.new_tokens)
    theirs = _hf_run(hf, ids, FLAGS.new_tokens)
    for side, r in (("kvjax", ours), ("transformers", theirs)):
      rows.append(dict(side=side, prompt_tokens=len(ids), new_tokens=FLAGS.new_tokens,
                       jax_backend=jax.default_backend(), torch_threads=torch.get_num_threads(),
                       **r))
    print(f"{len(ids):6d} tokens | prefill s: kvjax {ours['prefill_s']:.2f}, transformers "
          f"{theirs['prefill_s']:.2f} (ratio {theirs['prefill_s'] / ours['prefill_s']:.2f}x) | "
          f"decode tok/s: kvjax {ours['decode_tokens_per_s']:.1f}, transformers "
          f"{theirs['decode_tokens_per_s']:.1f} "
          f"(ratio {ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x)", flush=True)
  out = pathlib.Path(FLAGS.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(json.dumps(r) + "\n" for r in rows))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
