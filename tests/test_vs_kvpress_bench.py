"""benchmarks/vs_kvpress.py end to end on a tiny configuration: plumbing only, no timings.

Four child processes (kvjax and kvpress, full cache and snapkv) each load the
model, so this takes about a minute on a busy 2-core machine.
"""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "vs_kvpress.py"
CONTEXT, BUDGET, STEPS = 256, 64, 4
POSITIVE = ("prefill_s", "decode_s", "decode_tokens_per_s", "decode_ms_per_step", "kv_bytes",
            "kv_bytes_end", "baseline_rss_bytes", "peak_rss_bytes", "lifetime_peak_rss_bytes",
            "prompt_tokens", "context_tokens", "question_tokens", "compressed_tokens", "child_s")
FIELDS = POSITIVE + ("side", "policy", "context_length", "budget", "decode_steps", "window",
                     "query_aware", "warmup", "repeats", "prefill_chunk", "prefill_runs",
                     "decode_runs", "compile_s", "peak_rss_kind", "token_ids", "backend",
                     "loadavg")


def _run(out, *args):
  return subprocess.run([sys.executable, str(SCRIPT), f"--out={out}", *args],
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_rows_and_summary(tmp_path):
  proc = _run(tmp_path, f"--context_lengths={CONTEXT}", f"--budget={BUDGET}",
              f"--decode_steps={STEPS}", "--policies=snapkv")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert sorted((r["policy"], r["side"]) for r in rows) == [
      ("full", "kvjax"), ("full", "kvpress"), ("snapkv", "kvjax"), ("snapkv", "kvpress")]
  for r in rows:
    missing = [f for f in FIELDS if f not in r]
    assert not missing, (r["side"], r["policy"], missing)
    for f in POSITIVE:
      assert isinstance(r[f], (int, float)) and r[f] > 0, (r["side"], r["policy"], f, r[f])
    assert len(r["token_ids"]) == STEPS and r["decode_steps"] == STEPS
    assert r["context_length"] == CONTEXT and r["prompt_tokens"] <= CONTEXT
    assert r["prompt_tokens"] == r["context_tokens"] + r["question_tokens"]
    assert r["query_aware"] is False and r["compressed_tokens"] == r["context_tokens"]
    # The best of the timed runs; tokens/s counts the first token, ms/step the forwards.
    assert len(r["decode_runs"]) == len(r["prefill_runs"]) == r["repeats"]
    assert (r["decode_s"], r["prefill_s"]) == (min(r["decode_runs"]), min(r["prefill_runs"]))
    assert r["decode_tokens_per_s"] == pytest.approx(STEPS / r["decode_s"])
    assert r["decode_ms_per_step"] == pytest.approx(1e3 * r["decode_s"] / (STEPS - 1))
    assert r["budget"] == (None if r["policy"] == "full" else BUDGET)
    if r["side"] == "kvjax":
      assert r["compile_s"] > 0  # its own process: it compiled its programs
    else:
      assert r["compile_s"] is None
  by = {(r["policy"], r["side"]): r for r in rows}
  # kvpress's DynamicCache: every compressed token (full) or exactly the budget (snapkv)
  # after the prefill; then the question and the STEPS - 1 decoded tokens appended.
  full, snap = by["full", "kvpress"], by["snapkv", "kvpress"]
  per_token = 30 * 3 * 64 * 4 * 2  # SmolLM2-135M: L, K, H; float32 keys + values
  assert full["kv_bytes"] == full["compressed_tokens"] * per_token
  assert full["kv_bytes_end"] == (full["prompt_tokens"] + STEPS - 1) * per_token
  assert snap["kv_bytes"] == BUDGET * per_token
  assert snap["kv_bytes_end"] == (BUDGET + snap["question_tokens"] + STEPS - 1) * per_token
  assert by["snapkv", "kvjax"]["kv_bytes"] < by["full", "kvjax"]["kv_bytes"]
  summary = (tmp_path / "summary.md").read_text()
  assert f"## {CONTEXT} tokens" in summary
  for policy in ("full", "snapkv"):
    for side in ("kvjax", "kvpress"):
      assert f"| {policy} | {side} |" in summary
  assert summary in proc.stdout  # printed at the end

  # A second run finds every configuration done and only rewrites the summary.
  again = _run(tmp_path, f"--context_lengths={CONTEXT}", f"--budget={BUDGET}",
               f"--decode_steps={STEPS}", "--policies=snapkv")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "[1/4]" not in again.stdout
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4

  # With --prefill_chunk only kvjax's compressed run is new: the full cache and
  # kvpress prefill in one shot, so their rows are reused.
  chunked = _run(tmp_path, f"--context_lengths={CONTEXT}", f"--budget={BUDGET}",
                 f"--decode_steps={STEPS}", "--policies=snapkv", "--prefill_chunk=128")
  assert chunked.returncode == 0, chunked.stderr[-3000:]
  assert [l.split(":")[0] for l in chunked.stdout.splitlines() if l.startswith("[")] == [
      f"[3/4] kvjax snapkv {CONTEXT}"]
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert [(r["side"], r["policy"], r["prefill_chunk"]) for r in rows[4:]] == [
      ("kvjax", "snapkv", 128)]
  # Its pool holds the budget alone, as the one-shot run's: the chunk is never in it.
  assert rows[4]["kv_bytes"] == by["snapkv", "kvjax"]["kv_bytes"]
  summary = (tmp_path / "summary.md").read_text()
  assert "| snapkv | kvjax (chunks of 128) |" in summary and "| full | kvjax |" in summary


@pytest.mark.parametrize("args, message", [
    (["--policies=h2o"], "--policies must name policies with a kvpress press"),
    (["--context_lengths=4k"], "--context_lengths must be a comma list of ints"),
    (["--decode_steps=1"], "--decode_steps must be >= 2"),
    (["--prefill_chunk=-1"], "--prefill_chunk must be >= 0"),
    (["--budget=8"], "--budget: budget 8 must exceed"),
    (["--context_lengths=512", "--budget=1024"], "not above --budget 1024"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, message):
  proc = _run(tmp_path, *args)
  assert proc.returncode == 2, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], proc.stderr
  assert "Traceback" not in proc.stderr
