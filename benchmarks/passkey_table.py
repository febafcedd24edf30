r"""Passkey accuracy of every policy at several budgets, next to full cache and kvpress.

  python benchmarks/passkey_table.py --lengths=2048,4096 --budgets=64,128,256,512

One row per (side, policy, budget, length, mode, depth) in --out/results.jsonl
(resumable: rows already there are skipped), and --out/summary.md with the
accuracy table. Both modes: query-aware (the question is compressed with the
context, inside the window) and query-agnostic (the context is compressed,
then the question appended). kvpress runs the same presses on the same token
ids through transformers (SDPA attention, float32), compressing during the
prefill exactly as its pipeline does, with compression_ratio
1 - (budget + 0.5) / prompt tokens so that it keeps exactly the budget.
"""

import collections
import json
import os
import pathlib
import time

from absl import app
from absl import flags

import peers  # this folder: the press table and transformers' loading

flags.DEFINE_list("lengths", ["2048", "4096"], "Prompt lengths in tokens.")
flags.DEFINE_list("budgets", ["64", "128", "256", "512"], "KV entries per layer and KV head.")
flags.DEFINE_list("policies", ["streaming_llm", "snapkv", "pyramidkv", "knorm", "h2o", "chunkkv",
                               "sentencekv"], "kvjax policies besides full.")
flags.DEFINE_list("depths", ["0.2", "0.5", "0.8"], "Needle depths (one sample each).")
flags.DEFINE_list("modes", ["aware", "agnostic"], "Query-aware and/or query-agnostic.")
flags.DEFINE_integer("window", 16, "Observation window of snapkv/pyramidkv/chunkkv/sentencekv "
                     "and H2O's recent window, on both sides.")
flags.DEFINE_bool("kvpress", True, "Also run kvpress's presses.")
flags.DEFINE_string("out", "results/passkey_table", "Output folder.")
FLAGS = flags.FLAGS

MAX_NEW = 12


def _fields(policy):
  w = FLAGS.window
  return {"snapkv": {"window": w}, "pyramidkv": {"window": w}, "chunkkv": {"window": w},
          "sentencekv": {"window": w}, "h2o": {"recent": w}}.get(policy, {})


def _split(tok, sample):
  """Context and question token ids of a passkey prompt (the question starts at its text)."""
  cut = sample.prompt.index("\nWhat is the pass key?")
  return tok.encode(sample.prompt[:cut]), tok.encode(sample.prompt[cut:])


def _hf_answer(model, press, ctx, question, aware):
  import torch
  from transformers import DynamicCache
  cache = DynamicCache()
  first = ctx + question if aware else ctx
  with torch.no_grad():
    if press is None:
      out = model(torch.tensor([first]), past_key_values=cache, use_cache=True)
    else:
      with press(model):
        out = model(torch.tensor([first]), past_key_values=cache, use_cache=True)
    pos = len(first)
    if not aware:  # the question, uncompressed, at its original positions
      # One token at a time: with PyramidKV's per-layer cache lengths, transformers
      # builds a multi-token mask from layer 0's length that the other layers reject.
      for token in question:
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[pos]]))
        pos += 1
    tokens = []
    for _ in range(MAX_NEW):
      token = int(out.logits[0, -1].argmax())
      if token in (0, 2):
        break
      tokens.append(token)
      out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                  position_ids=torch.tensor([[pos]]))
      pos += 1
  return tokens


def main(argv):
  del argv
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import kvjax
  kvjax.runtime.setup()  # as the command-line tools run
  lm = kvjax.load()
  tok = lm.tokenizer
  out_dir = pathlib.Path(FLAGS.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = out_dir / "results.jsonl"
  done = set()
  if results.exists():
    for line in results.read_text().splitlines():
      r = json.loads(line)
      done.add((r["side"], r["policy"], r["budget"], r["length"], r["mode"], r["depth"]))
  hf = peers.load_transformers(lm.source) if FLAGS.kvpress else None

  jobs = []
  for length in map(int, FLAGS.lengths):
    for depth in map(float, FLAGS.depths):
      for mode in FLAGS.modes:
        jobs.append(("kvjax", "full", None, length, mode, depth))
        for budget in map(int, FLAGS.budgets):
          for policy in FLAGS.policies:
            jobs.append(("kvjax", policy, budget, length, mode, depth))
            if hf is not None and policy in peers.PRESSES:
              jobs.append(("kvpress", policy, budget, length, mode, depth))
  todo = [j for j in jobs if j not in done]
  print(f"{len(jobs)} runs, {len(todo)} to do", flush=True)
  with results.open("a") as f:
    for i, (side, policy, budget, length, mode, depth) in enumerate(todo):
      sample = kvjax.tasks.passkey_prompt(tok, context_tokens=length, depth=depth,
                                          seed=int(depth * 100))
      ctx, question = _split(tok, sample)
      aware = mode == "aware"
      start = time.perf_counter()
      if side == "kvjax":
        fields = _fields(policy)
        p = kvjax.policies.get(policy, **fields)
        if budget is not None and budget <= p.reserved():
          continue
        r = kvjax.generate(lm, [ctx], questions=[question], query_aware=aware, policy=p,
                           budget=budget, max_new_tokens=MAX_NEW)
        text = r.texts[0]
      else:
        n = len(ctx) + (len(question) if aware else 0)
        # +0.5: kvpress keeps int(n * (1 - ratio)) entries, which must not round down.
        press = peers.press(policy, budget, n, FLAGS.window)
        text = tok.decode(_hf_answer(hf, press, ctx, question, aware))
      row = dict(side=side, policy=policy, budget=budget, length=length, mode=mode,
                 depth=depth, window=FLAGS.window, prompt_tokens=len(ctx) + len(question),
                 answer=sample.answer, prediction=text, correct=sample.answer in text,
                 seconds=time.perf_counter() - start)
      f.write(json.dumps(row) + "\n")
      f.flush()
      print(f"[{i + 1}/{len(todo)}] {side} {policy} b={budget} {length} {mode} d={depth}: "
            f"{'ok' if row['correct'] else 'no'} {text.strip()[:30]!r}", flush=True)
  _summary(results, out_dir / "summary.md", set(map(float, FLAGS.depths)))


def _summary(results, path, depths):
  """Accuracy per (length, mode, side, policy, budget) over the rows at ``depths``."""
  rows = [json.loads(l) for l in results.read_text().splitlines()]
  rows = [r for r in rows if r["depth"] in depths]
  acc = collections.defaultdict(list)
  for r in rows:
    acc[(r["length"], r["mode"], r["side"], r["policy"], r["budget"])].append(r["correct"])
  budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
  lines = [f"# Passkey accuracy (SmolLM2-135M-Instruct, window {rows[0]['window']}, "
           f"needle depths {sorted(depths)})", ""]
  for length in sorted({r["length"] for r in rows}):
    for mode in ("aware", "agnostic"):
      full = acc.get((length, mode, "kvjax", "full", None))
      if not full:
        continue
      lines += [f"## {length} tokens, query-{mode} (full cache: "
                f"{100 * sum(full) / len(full):.0f}%, n={len(full)})", "",
                "| side | policy | " + " | ".join(map(str, budgets)) + " |",
                "|---|---|" + "---|" * len(budgets)]
      for side, policy in sorted({(k[2], k[3]) for k in acc if k[3] != "full"}):
        cells = []
        for b in budgets:
          v = acc.get((length, mode, side, policy, b))
          cells.append(f"{100 * sum(v) / len(v):.0f}%" if v else "–")
        lines.append(f"| {side} | {policy} | " + " | ".join(cells) + " |")
      lines.append("")
  path.write_text("\n".join(lines))
  print(path.read_text())


if __name__ == "__main__":
  app.run(main)
