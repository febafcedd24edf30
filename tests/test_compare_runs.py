"""benchmarks/compare_runs.py on two hand-written eval folders: labels, counts, one full row."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "compare_runs.py"


def _row(policy, budget, correct, *, length=2048, depth=0.5, aware=True, fields=None):
  return {"model": "m", "task": "niah", "haystack": "repeat", "policy": policy,
          "policy_fields": fields or {}, "budget": budget, "length": length, "depth": depth,
          "query_aware": aware, "prefill_chunk": 0, "metric": "contains",
          "correct": correct, "score": float(correct)}


def _write(folder: pathlib.Path, rows):
  folder.mkdir()
  (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_two_runs_side_by_side(tmp_path):
  _write(tmp_path / "old", [_row("full", None, True), _row("full", None, True, depth=0.1),
                            _row("sablock", 64, False, fields={"window": 16}),
                            _row("sablock", 64, False, depth=0.1, fields={"window": 16})])
  _write(tmp_path / "new", [_row("full", None, False),  # a second full run: not counted
                            _row("sablock", 64, True), _row("sablock", 64, False, depth=0.1)])
  out = tmp_path / "cmp"
  subprocess.run([sys.executable, str(SCRIPT), f"--out={out}", f"--run=old={tmp_path / 'old'}",
                  f"--run=new={tmp_path / 'new'}"], check=True, capture_output=True, timeout=300)
  text = (out / "summary.md").read_text()
  assert text.startswith("# Runs compared: old, new")
  overall = text.split("## query-aware: every length, depth and haystack")[1].split("\n\n")[1]
  assert overall.splitlines()[2:] == [
      "| full | 100% (2) |",
      "| sablock (run=new) | 50% (2) |",
      "| sablock (run=old, window=16) | 0% (2) |",
  ]
  assert (out / "accuracy_vs_budget_niah_repeat_aware.png").stat().st_size > 0
