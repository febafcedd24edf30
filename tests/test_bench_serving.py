"""The serving benchmark: a workload of task prompts replayed against the engine, and its report."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvjax.bench import serving
from kvjax.bench import serving_report

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_run(smollm2_lm, tmp_path_factory):
  """4 passkey requests of ~200 tokens, all at once, under full and snapkv @ 64, in a pool
  of 2 full-cache requests; returns (rows, output folder, workload, pool)."""
  out = tmp_path_factory.mktemp("serving")
  workload = serving.make_workload(smollm2_lm.tokenizer, task="passkey", count=4,
                                   prompt_tokens=200, rate=math.inf, seed=0, max_tokens=8)
  configs = serving.parse_policies(["full", "snapkv:64"], window=16)
  settings = serving.EngineSettings(max_slots=4, prefill_chunk=128, steps_per_dispatch=2,
                                    backend="xla")
  pool = serving.full_cache_pool(smollm2_lm, workload, 2, settings)
  rows = serving.run(smollm2_lm, configs, workload, pool, settings, out, model="smollm2",
                     progress=False)
  return rows, out, workload, pool


def test_the_files_are_written_with_a_row_per_configuration(small_run):
  rows, out, _, _ = small_run
  assert sorted(p.name for p in out.iterdir()) == ["pages.png", "results.jsonl", "summary.md"]
  lines = (out / "results.jsonl").read_text().splitlines()
  assert [json.loads(l)["label"] for l in lines] == ["full", "snapkv (window=16) @ 64"]
  assert (out / "pages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = [l for l in (out / "summary.md").read_text().splitlines() if l.startswith("| ")]
  assert len(table) == 3  # the header and both configurations
  assert table[1].startswith("| full | 4/4 |") and "1.00x" in table[1]
  assert table[2].startswith("| snapkv (window=16) @ 64 | 4/4 |")


def test_every_request_completes_and_the_figures_agree(small_run):
  rows, _, workload, pool = small_run
  for row in rows:
    assert row["completed"] == row["num_requests"] == 4
    assert row["num_pages"] == pool.num_pages and row["max_slots"] == 4
    assert row["output_tokens"] == sum(r["tokens"] for r in row["requests"]) > 0
    assert all(1 <= r["tokens"] <= 8 for r in row["requests"])
    numbers = [row[k] for k in ("output_tokens_per_s", "requests_per_s", "duration_s",
                                "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                                "mean_concurrency", "accuracy")]
    assert all(math.isfinite(v) and v >= 0 for v in numbers), numbers
    assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
    assert row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["duration_s"]
    assert row["tpot_p50_s"] <= row["tpot_p99_s"]
    assert 1 <= row["peak_concurrency"] <= row["max_slots"]
    assert 0 < row["mean_concurrency"] <= row["peak_concurrency"]
    timeline = row["timeline"]
    assert timeline["t"] == sorted(timeline["t"]) and len(timeline["t"]) == row["num_steps"]
    pages, in_step = timeline["pages"], timeline["pages_in_step"]
    assert all(0 <= p <= q for p, q in zip(pages, in_step))
    assert max(in_step) == row["peak_pages"] <= row["num_pages"]  # never above the pool
    assert pages[-1] == 0 < in_step[-1] and sum(timeline["ended"]) == 4
    for r, w in zip(row["requests"], workload.requests):
      assert r["arrival_s"] <= r["submit_s"] <= r["first_s"] <= r["end_s"]
      assert r["prompt_tokens"] == len(w.ids) and r["answers"] == list(w.sample.answers)
  full, snapkv = rows
  # The same pool holds more requests that keep 64 entries per head than full ones.
  assert snapkv["peak_concurrency"] >= full["peak_concurrency"]
  assert snapkv["policy_settings"]["window"] == 16 and snapkv["budget"] == 64


def test_arrivals_are_poisson_and_seeded():
  times = serving.arrivals(4000, 5.0, seed=3)
  assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
  assert abs(np.diff(times).mean() - 0.2) < 0.02  # mean gap 1 / rate
  np.testing.assert_array_equal(times, serving.arrivals(4000, 5.0, seed=3))
  assert not np.array_equal(times, serving.arrivals(4000, 5.0, seed=4))
  np.testing.assert_array_equal(serving.arrivals(3, math.inf, seed=0), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("entries, words", [
    ([], ["--serving_policies is empty"]),
    (["snapkv:abc"], ["'snapkv:abc'", "expected a budget"]),
    (["snapkv"], ["'snapkv'", "needs a budget"]),
    (["full:128"], ["'full:128'", "budget must be None"]),
    (["nope:64"], ["'nope:64'", "unknown policy"]),
    (["snapkv:32"], ["'snapkv:32'", "must exceed"]),
    (["snapkv:128", "snapkv:128"], ["repeats snapkv @ 128"]),
])
def test_bad_policy_entries_are_refused(entries, words):
  with pytest.raises(ValueError) as info:
    serving.parse_policies(entries)
  for word in words:
    assert word in str(info.value), (word, str(info.value))


def test_policy_entries_take_a_budget_and_fields():
  full, snap, sab = serving.parse_policies(["full", "snapkv:512", "sablock:256:window=8"])
  assert (full.label, full.budget) == ("full", None)
  assert (snap.label, snap.budget) == ("snapkv @ 512", 512)
  assert (sab.label, sab.fields) == ("sablock (window=8) @ 256", {"window": 8})


def _row(label: str, policy: str, tokens_per_s: float, peak: int) -> dict:
  return {"label": label, "policy": policy, "completed": 2, "num_requests": 2,
          "output_tokens_per_s": tokens_per_s, "requests_per_s": 0.5, "ttft_p50_s": 1.0,
          "ttft_p99_s": 2.0, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02, "peak_concurrency": peak,
          "mean_concurrency": peak / 2, "peak_pages": 10, "preemptions": 0, "accuracy": 0.5,
          "model": "m", "device_kind": "cpu", "backend": "xla", "task": "passkey",
          "prompt_tokens_min": 99, "prompt_tokens_max": 100, "prompt_tokens": 100,
          "max_tokens": 8, "rate": "inf", "seed": 0, "num_pages": 20,
          "pool_full_requests": 2, "kv_memory": None, "max_slots": 4, "steps_per_dispatch": 8,
          "page_size": 16,
          "timeline": {"t": [0.5, 1.0], "pages": [10, 0], "pages_in_step": [10, 10]}}


def test_the_summary_gives_each_policy_its_ratio_to_the_full_cache(tmp_path):
  rows = [_row("full", "full", 10.0, 2), _row("snapkv @ 64", "snapkv", 25.0, 4)]
  text = serving_report.write(rows, tmp_path)
  full, snap = [l for l in text.splitlines() if l.startswith("| full") or l.startswith("| snap")]
  assert full.split(" | ")[3] == "1.00x" and snap.split(" | ")[3] == "2.50x"
  assert snap.split(" | ")[10] == "2.00x"  # peak concurrency
  assert (tmp_path / "pages.png").is_file()
  no_full = serving_report.summary_markdown(rows[1:])
  assert "| snapkv @ 64 | 2/2 | 25.0 | – |" in no_full


@pytest.mark.slow
def test_the_command_line_runs_the_preset(tmp_path):
  """``python -m kvjax.bench --preset=serving`` end to end (a fresh process loads the model)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--preset=serving", f"--out={tmp_path}",
       "--serving_policies=full,snapkv:64", "--window=16", "--serving_requests=3",
       "--serving_prompt_tokens=150", "--serving_max_tokens=4", "--serving_pool=2",
       "--serving_max_slots=3", "--serving_rate=50", "--backend=xla", "--prefill_chunk=128"],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| snapkv (window=16) @ 64 | 3/3 |" in proc.stdout
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert [r["rate"] for r in rows] == [50.0, 50.0]
