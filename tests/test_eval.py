"""The evaluation CLI end to end on a tiny run: outputs, resuming, bad input."""

import json
import subprocess
import sys

import pytest

from kvjax import policies
from kvjax.eval import policy_entries
from kvjax.eval import report
from kvjax.eval import runner

# SnapKV at its own defaults: a budget above its observation window.
TINY = dict(policies=("full", "snapkv"), budgets=(96,), lengths=(320,), depths=(0.5,),
            haystacks=("repeat",))


def test_tiny_run_writes_every_output_and_resumes(smollm2_lm, tmp_path):
  cfg = runner.EvalConfig(**TINY)
  rows = runner.run(cfg, tmp_path, progress=False, lm=smollm2_lm)
  assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("snapkv", 96)]
  for r in rows:
    for field in ("model", "task", "policy", "budget", "length", "depth", "query_aware",
                  "correct", "score", "prediction", "answer", "prefill_s", "decode_s",
                  "kv_bytes"):
      assert field in r, field
    assert (r["model"], r["task"], r["metric"]) == (cfg.model, "niah", "contains")
    assert r["length"] == 320 and r["depth"] == 0.5 and r["query_aware"] is True
    assert 320 - 3 <= r["prompt_tokens"] <= 320  # make_sample: within a few tokens of it
    assert r["score"] == float(r["answer"][0] in r["prediction"])
    assert r["correct"] == (r["score"] == 1.0)  # "contains": correct only when it is there
  full, snap = rows
  # Both rows count the sample's one shared forward, and then their own work.
  assert 0 < full["shared_prefill_s"] == snap["shared_prefill_s"] < snap["prefill_s"]
  assert full["correct"]  # the full cache answers this prompt
  assert snap["kv_bytes"] < full["kv_bytes"]
  # No --window: SnapKV ran at its defaults, every one of them recorded.
  assert snap["policy_fields"] == {} and full["policy_settings"] == {}
  assert snap["policy_settings"] == policy_entries.settings(policies.get("snapkv"))
  text = report.write_report(rows, tmp_path)
  assert "| **full** | 100% (1) |" in text and "| snapkv | " in text
  assert f"| snapkv | {policy_entries.settings_text(snap['policy_settings'])} |" in text
  written = sorted(p.name for p in tmp_path.iterdir())
  assert written == ["accuracy_vs_budget_niah_repeat_aware.png", "heatmap_niah_repeat_aware_b96.png",
                     "results.jsonl", "summary.md"]
  # Resuming: nothing left to run, the same rows come back, the file does not grow.
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  again = runner.run(cfg, tmp_path, progress=False, lm=smollm2_lm)
  assert again == rows
  assert (tmp_path / "results.jsonl").read_text().splitlines() == lines
  # A larger run only adds its new rows.
  more = runner.run(runner.EvalConfig(**{**TINY, "budgets": (96, 128)}), tmp_path,
                    progress=False, lm=smollm2_lm)
  assert len(more) == 3
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_dataset_task(smollm2_lm, tmp_path):
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"context": "The secret word is pineapple. " * 5,
                              "question": "What is the secret word?",
                              "answer_prefix": "The secret word is",
                              "answer": ["pineapple"], "id": "bob"}) + "\n")
  cfg = runner.EvalConfig(task="dataset", dataset=str(data), policies=("full",),
                          metric="contains", max_new_tokens=12)
  (row,) = runner.run(cfg, tmp_path / "out", progress=False, lm=smollm2_lm)
  assert row["id"] == "bob" and row["task"] == "dataset" and row["metric"] == "contains"
  # Dataset prompts are grouped by the power of two their length rounds up to.
  assert row["length"] == runner.length_bucket(row["prompt_tokens"]) == 64
  assert row["correct"], row["prediction"]


def test_summary_table_by_hand():
  base = dict(model="m", task="niah", haystack="repeat", query_aware=True, prefill_chunk=0,
              length=1024, depth=0.5, metric="contains", policy_fields={})
  rows = [dict(base, policy="full", budget=None, correct=True, score=1.0),
          dict(base, policy="snapkv", budget=64, correct=False, score=0.0),
          dict(base, policy="snapkv", budget=64, correct=True, score=1.0),
          dict(base, policy="snapkv", budget=128, correct=True, score=1.0)]
  text = report.summary_markdown(rows)
  assert "| policy | 64 | 128 |" in text
  assert "| **full** | 100% (1) | 100% (1) |" in text
  assert "| snapkv | 50% (2) | 100% (1) |" in text


@pytest.mark.parametrize("args, message", [
    (["--budgets=x"], "--budgets must be a comma list of ints"),
    (["--no_such_flag"], "Unknown command line flag"),
    (["--depths=1.5"], "--depths must lie in [0, 1]"),
    (["--task=dataset"], "--dataset goes with --task=dataset"),
    (["--task=dataset", "--dataset=/no/such.jsonl"], "does not exist"),
    (["--policies=bogus"], "unknown policy 'bogus'"),
    (["--policies=full,paged_eviction:candidates=x"], "paged_eviction's candidates takes an int"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, message):
  proc = subprocess.run([sys.executable, "-m", "kvjax.eval", f"--out={tmp_path}", *args],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], proc.stderr
  assert "Traceback" not in proc.stderr
