r"""Compress once, answer many: the saved cache's size on disk, save and load times, and
the time to answer from it against a fresh prefill of document + question.

  python benchmarks/saved_cache.py --length=4096 --policies=full,snapkv:256,sablock:256

One multi-key NIAH document (kvjax.tasks, --length tokens with chat markup,
--needles facts "the special magic number for <name> is <n>"), one question
per fact. Per policy: ``kvjax.compress`` the document (query-agnostic: no
question in it), ``kvjax.save_cache`` it, ``kvjax.load_cache`` it, then
``kvjax.answer`` every question from the loaded cache; and, for each question,
``kvjax.generate(..., query_aware=False)`` from the text (the document's
prefill and compression, the question appended, the decode), whose greedy
tokens the answers must equal. Programs are compiled by a warm-up round
first; times are wall-clock seconds of warm calls (save and load: the best of
--repeats). Writes --out/results.json and the markdown table to --report.
"""

import json
import logging
import pathlib
import platform
import re
import shutil
import statistics
import sys
import time

from absl import app
from absl import flags
import jax

import kvjax

flags.DEFINE_string("model", "smollm2-135m-instruct", "Registry name, .gguf path or folder.")
flags.DEFINE_integer("length", 4096, "Document + question length in tokens.")
flags.DEFINE_list("policies", ["full", "snapkv:256", "sablock:256"],
                  "name[:budget] entries (no budget: full).")
flags.DEFINE_enum("haystack", "natural", ["natural", "repeat"], "Filler of the document.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens per answer (greedy; stops at end of turn).")
flags.DEFINE_integer("repeats", 3, "Save and load runs; the best is reported.")
flags.DEFINE_string("out", "results/saved_cache", "Folder for the saved caches and results.json.")
flags.DEFINE_string("report", "docs/results/saved_cache.md", "Markdown report.")
FLAGS = flags.FLAGS

_FACT = re.compile(r"The special magic number for (\w+) is (\d+)\.")


def _questions(sample):
  """(question tail, expected answer) for every fact of the document, in its order."""
  facts = dict(_FACT.findall(sample.context))
  first = re.search(r"What is the special magic number for (\w+)\?", sample.question).group(1)
  # The name is asked for, and named again in a base model's answer lead-in.
  return [(sample.question.replace(f"number for {first}", f"number for {name}"), value)
          for name, value in facts.items()]


def _folder_bytes(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _best(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return min(times), out


def _ready(context):
  jax.block_until_ready(context.cache)
  return context


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def _run_policy(lm, sample, questions, name, budget, out):
  kw = dict(policy=name, budget=budget)
  ids = [lm.tokenizer.encode(q) for q, _ in questions]
  # What the questions and answers take per head (only whole-page policies care).
  room = -(-max(map(len, ids)) // 64) * 64 + FLAGS.max_new_tokens
  answer_kw = dict(max_new_tokens=FLAGS.max_new_tokens)
  path = out / f"{name}-{budget or 'all'}"
  # Warm-up: every program compiled once.
  warm = kvjax.compress(lm, [sample.context], room=room, **kw)
  kvjax.save_cache(path, warm, overwrite=True)
  kvjax.answer(lm, kvjax.load_cache(path, lm), questions[0][0], **answer_kw)
  kvjax.generate(lm, [sample.context], questions=[questions[0][0]], query_aware=False,
                 **answer_kw, **kw)
  del warm

  compress_s, context = _timed(lambda: kvjax.compress(lm, [sample.context], room=room, **kw))
  save_s, _ = _best(lambda: kvjax.save_cache(path, context, overwrite=True), FLAGS.repeats)
  disk = _folder_bytes(path)
  load_s, loaded = _best(lambda: _ready(kvjax.load_cache(path, lm)), FLAGS.repeats)
  rows = []
  for question, value in questions:
    answer_s, (got,) = _timed(lambda: kvjax.answer(lm, loaded, question, **answer_kw))
    fresh_s, want = _timed(lambda: kvjax.generate(
        lm, [sample.context], questions=[question], query_aware=False, **answer_kw, **kw))
    rows.append(dict(answer_s=answer_s, answer_append_s=got.stats.prefill_s,
                     answer_decode_s=got.stats.decode_s, fresh_s=fresh_s,
                     fresh_prefill_s=want.stats.prefill_s, fresh_decode_s=want.stats.decode_s,
                     same_tokens=got.token_ids == want.token_ids, correct=value in got.texts[0],
                     text=got.texts[0]))
  return dict(policy=name, budget=budget, document_tokens=int(context.lengths[0]),
              kv_bytes=context.kv_bytes, disk_bytes=disk, compress_s=compress_s, save_s=save_s,
              load_s=load_s, questions=rows)


def _report(results, command, lm, sample_tokens, questions):
  mib = lambda n: f"{n / 2**20:.1f} MiB"
  med = lambda r, k: statistics.median(q[k] for q in r["questions"])
  full = next((r for r in results if r["policy"] == "full"), None)
  machine = platform.processor() or platform.machine()
  lines = [
      "# Compress once, answer many: a saved compressed cache",
      "",
      "```",
      command,
      "```",
      "",
      f"{FLAGS.model} (float32, {jax.default_backend()}: {machine}, "
      f"{jax.device_count()} device), one {FLAGS.haystack}-haystack "
      f"multi-key NIAH document of {sample_tokens} tokens (chat markup included, question "
      f"excluded), {len(questions)} questions about it (one per fact), greedy answers of up "
      f"to {FLAGS.max_new_tokens} tokens. Query-agnostic: the document is compressed without "
      "the question (`kvjax.compress`), saved (`kvjax.save_cache`) and loaded "
      "(`kvjax.load_cache`) once; each question is then appended to a copy of the loaded "
      "cache and answered (`kvjax.answer`). *Fresh* is `kvjax.generate(..., "
      "query_aware=False)` on the text: prefill and compression of the document, the "
      "question appended, the decode. Wall-clock seconds of warm calls (programs compiled by "
      f"a warm-up round); save and load: the best of {FLAGS.repeats}. The machine's two "
      "CPU cores were shared with other jobs: times are indicative.",
      "",
      "| policy | budget | cache in memory | on disk | vs full on disk | compress | save | "
      "load | answer (median) | of which question append | fresh prefill + answer (median) "
      "| speed-up | same tokens | correct |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    ratio = f"{r['disk_bytes'] / full['disk_bytes']:.3f}" if full else "-"
    n = len(r["questions"])
    lines.append(
        f"| {r['policy']} | {r['budget'] or '-'} | {mib(r['kv_bytes'])} | "
        f"{mib(r['disk_bytes'])} | {ratio} | {r['compress_s']:.2f} s | {r['save_s']:.2f} s | "
        f"{r['load_s']:.2f} s | {med(r, 'answer_s'):.2f} s | {med(r, 'answer_append_s'):.2f} s "
        f"| {med(r, 'fresh_s'):.2f} s | {med(r, 'fresh_s') / med(r, 'answer_s'):.1f}x | "
        f"{sum(q['same_tokens'] for q in r['questions'])}/{n} | "
        f"{sum(q['correct'] for q in r['questions'])}/{n} |")
  lines += [
      "",
      "*cache in memory*: the page pool's keys and values (`CompressedContext.kv_bytes`); "
      "*on disk*: every file of the orbax folder (all arrays of the cache, its metadata). "
      "*same tokens*: the answers from the loaded cache equal the fresh run's greedy tokens. "
      "*correct*: the answer holds the fact's number.",
      "",
      "Answers from the loaded cache, per question:",
      "",
  ]
  for r in results:
    texts = "; ".join(repr(q["text"]) for q in r["questions"])
    lines.append(f"- {r['policy']} {r['budget'] or ''}: {texts}")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  kvjax.runtime.setup()  # as the command-line tools run
  for noisy in ("jax", "absl"):  # orbax logs a dozen INFO lines per checkpoint
    logging.getLogger(noisy).setLevel(logging.WARNING)
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  lm = kvjax.load(FLAGS.model)
  sample = kvjax.tasks.make_sample(lm.tokenizer, "niah_multikey", length=FLAGS.length,
                                   haystack=FLAGS.haystack)
  questions = _questions(sample)
  results = []
  for entry in FLAGS.policies:
    name, _, budget = entry.partition(":")
    result = _run_policy(lm, sample, questions, name, int(budget) if budget else None, out)
    print(json.dumps({k: v for k, v in result.items() if k != "questions"}), flush=True)
    results.append(result)
    shutil.rmtree(out / f"{name}-{budget or 'all'}", ignore_errors=True)
  (out / "results.json").write_text(json.dumps(results, indent=1))
  command = "python " + " ".join(["benchmarks/saved_cache.py", *sys.argv[1:]])
  report = _report(results, command, lm, results[0]["document_tokens"], questions)
  pathlib.Path(FLAGS.report).write_text(report)
  print(report)


if __name__ == "__main__":
  app.run(main)
