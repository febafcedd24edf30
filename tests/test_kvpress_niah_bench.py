"""benchmarks/kvpress_niah.py on one short NIAH prompt: its rows, its check against kvpress, a rerun.

One process loads SmolLM2 in transformers and runs two presses, twice (the
rerun loads the model and finds every row): about a minute on a 2-core
machine, so it runs with -m slow.
"""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "kvpress_niah.py"
ARGS = ["--lengths=512", "--depths=0.5", "--haystacks=repeat", "--budgets=64,128",
        "--presses=knorm,snapkv", "--check_budget=96"]


def _run(out):
  proc = subprocess.run([sys.executable, str(SCRIPT), f"--out={out}", *ARGS],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rows_match_kvpress_own_hook_and_a_rerun_reuses_them(tmp_path):
  rows = _run(tmp_path)
  want = {("full", None, aware) for aware in (True, False)} | {
      (f"kvpress_{p}", b, aware) for p in ("knorm", "snapkv") for b in (64, 128)
      for aware in (True, False)}
  assert sorted((r["policy"], r["budget"], r["query_aware"]) for r in rows) == sorted(
      want, key=lambda k: (k[0], k[1] or 0, k[2]))
  for r in rows:
    assert r["id"].startswith("niah-repeat-512-0.5") and r["answer"], r
    assert isinstance(r["prediction"], str) and r["correct"] == (r["answer"][0] in r["prediction"])
    assert r["kv_bytes"] > 0
  by = {(r["policy"], r["budget"], r["query_aware"]): r for r in rows}
  assert by["kvpress_snapkv", 64, True]["policy_settings"]["window_size"] == 64
  assert by["full", None, True]["correct"]  # the uncompressed cache finds a 512-token needle
  check = json.loads((tmp_path / "check.json").read_text())
  assert check["budget"] == 96
  assert check["agreement"] == {f"{p} {m}": 1.0 for p in ("knorm", "snapkv")
                                for m in ("query-aware", "query-agnostic")}
  assert _run(tmp_path) == rows  # every row was there: nothing ran again
