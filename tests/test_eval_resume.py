"""Resuming an eval never reports wrong results: keys, duplicate ids, torn lines, stale reports.

A tiny random model with SmolLM2's tokenizer runs the samples in seconds; its
predictions are meaningless but deterministic, which is all resuming needs.
"""

import dataclasses
import json
import pathlib

import hypothesis
from hypothesis import strategies as st
import pytest

import kvjax
from kvjax import plots
from kvjax.eval import report
from kvjax.eval import results
from kvjax.eval import runner
from kvjax.models.tokenizer import Tokenizer

# --window=16: SnapKV's own window (64) would not fit these small budgets.
NIAH = dict(policies=("full", "snapkv"), budgets=(48,), lengths=(160,), depths=(0.5,),
            haystacks=("repeat",), max_new_tokens=3, window=16)
DATASET = dict(task="dataset", policies=("full",), metric="contains", max_new_tokens=3)


@pytest.fixture(scope="module")
def lm(smollm2_path):
  tokenizer = Tokenizer.from_gguf(smollm2_path)
  config = kvjax.LlamaConfig(
      vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
      tie_embeddings=True)
  return dataclasses.replace(kvjax.init_random(config, seed=0), tokenizer=tokenizer)


def _run(lm, out, progress=False, **fields):
  return runner.run(runner.EvalConfig(**fields), out, progress=progress, lm=lm)


def _write_jsonl(path: pathlib.Path, rows) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _facts(words, answers):
  return [{"context": f"The code word is {w}. " * 4, "question": "What is the code word?",
           "answer": [a]} for w, a in zip(words, answers)]


def _lines(path: pathlib.Path) -> list[dict]:
  text = path.read_text()
  assert text.endswith("\n")
  return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("same_path", [False, True], ids=["two_files", "file_rewritten"])
def test_two_datasets_without_ids_never_share_rows(lm, tmp_path, same_path):
  out = tmp_path / "out"
  first = _write_jsonl(tmp_path / "a.jsonl", _facts(["apple", "pear"], ["never-said"] * 2))
  rows_a = _run(lm, out, dataset=str(first), **DATASET)
  assert [r["id"] for r in rows_a] == ["0", "1"] and not any(r["correct"] for r in rows_a)
  # The second dataset asks other facts; its answers are what the model says, so
  # its accuracy (100%) differs from the first's (0%) only if its rows really run.
  second = _write_jsonl(first if same_path else tmp_path / "b.jsonl",
                        _facts(["plum", "fig"], ["?"] * 2))
  probe = _run(lm, tmp_path / "probe", dataset=str(second), **DATASET)
  second = _write_jsonl(second, _facts(["plum", "fig"], [r["prediction"] for r in probe]))
  rows_b = _run(lm, out, dataset=str(second), **DATASET)
  assert (rows_b.reused, rows_b.ran) == (0, 2)
  assert [r["answer"] for r in rows_b] == [[r["prediction"]] for r in probe]
  assert all(r["correct"] for r in rows_b)
  text = report.write_report(rows_b, out)
  assert "| **full** | 100% (2) |" in text and "(4)" not in text
  assert len(_lines(out / "results.jsonl")) == 4  # both runs' rows, neither lost


def test_duplicate_ids_are_refused_with_rows_and_lines(lm, tmp_path):
  facts = _facts(["a", "b", "c", "d"], ["x"] * 4)
  ids = ["k", "m", "k", None]
  path = tmp_path / "d.jsonl"
  lines = [json.dumps(dict(f, id=i) if i else f) for f, i in zip(facts, ids)]
  path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")  # a blank line 2
  with pytest.raises(ValueError, match=r"d\.jsonl: line 1 and line 4 share the id 'k'"):
    _run(lm, tmp_path / "out", dataset=str(path), **DATASET)
  assert not (tmp_path / "out" / "results.jsonl").exists()  # refused before any work
  # A row without an id takes its 0-based index, which another row may name.
  path.write_text("\n".join(json.dumps(dict(f, id=i) if i else f)
                            for f, i in zip(facts[:2], [None, "0"])) + "\n")
  with pytest.raises(ValueError, match=r"line 1 and line 2 share the id '0'"):
    _run(lm, tmp_path / "out", dataset=str(path), **DATASET)
  # Whatever made them, samples sharing an id are refused before they run.
  sample = runner.Sample("c", "q", ("a",), 3, id="s")
  with pytest.raises(ValueError, match=r"samples share ids: 's' \(samples 1, 3\)"):
    runner.check_unique_ids([sample, dataclasses.replace(sample, id="t"), sample])


@pytest.mark.parametrize("tear", ["half_a_row", "junk_with_newline"])
def test_a_torn_last_line_is_reported_dropped_and_rerun(lm, tmp_path, capsys, tear):
  rows = _run(lm, tmp_path, **NIAH)
  path = tmp_path / "results.jsonl"
  good = path.read_text().splitlines(keepends=True)
  torn = good[1][:len(good[1]) // 2] if tear == "half_a_row" else "{not json\n"
  path.write_text(good[0] + torn)
  capsys.readouterr()
  again = _run(lm, tmp_path, **NIAH)
  warnings = [l for l in capsys.readouterr().err.splitlines() if "torn last line" in l]
  assert warnings == [f"warning: {path}:2: torn last line (an interrupted write) dropped; "
                      "its row runs again"]
  assert (again.reused, again.ran) == (1, 1)
  assert _lines(path) == [json.loads(good[0]), again[1]]  # the next row is intact
  assert again[1]["prediction"] == rows[1]["prediction"]  # greedy: the same answer again
  _run(lm, tmp_path, **NIAH)  # nothing torn any more: no second warning
  assert "torn" not in capsys.readouterr().err


def test_a_corrupt_middle_line_is_an_error_naming_file_and_line(lm, tmp_path):
  _run(lm, tmp_path, **NIAH)
  path = tmp_path / "results.jsonl"
  first, second = path.read_text().splitlines(keepends=True)
  for bad in ("{torn\n", "[1, 2]\n", "\xff\n"):
    path.write_text(bad + second)
    with pytest.raises(results.ResultsError, match=f"{path}:1: not a results row"):
      _run(lm, tmp_path, **NIAH)
    assert path.read_text() == bad + second  # left as it was, for the user to look at


def test_changed_flags_run_new_rows_and_report_only_this_run(lm, tmp_path):
  _run(lm, tmp_path, **NIAH)
  other_budget = _run(lm, tmp_path, **{**NIAH, "budgets": (64,)})
  assert (other_budget.reused, other_budget.ran) == (1, 1)  # the full cache's row is the same work
  assert [(r["policy"], r["budget"]) for r in other_budget] == [("full", None), ("snapkv", 64)]
  text = report.write_report(other_budget, tmp_path)
  assert "| policy | 64 |" in text and "48" not in text.split("## ")[1]
  other_window = _run(lm, tmp_path, **{**NIAH, "window": 8})
  assert other_window.ran == 1 and other_window[1]["policy_fields"] == {"window": 8}
  other_mode = _run(lm, tmp_path, **{**NIAH, "query_aware": False})
  assert (other_mode.reused, other_mode.ran) == (0, 2)
  assert len(_lines(tmp_path / "results.jsonl")) == 2 + 1 + 1 + 2


def test_stale_plots_and_summary_are_removed(lm, tmp_path, monkeypatch):
  (tmp_path / "notes.png").write_bytes(b"mine")  # not the report's: kept
  two = _run(lm, tmp_path, **{**NIAH, "budgets": (48, 64)})
  report.write_report(two, tmp_path)
  assert (tmp_path / "heatmap_niah_repeat_aware_b48.png").exists()
  one = _run(lm, tmp_path, **{**NIAH, "budgets": (64,)})
  report.write_report(one, tmp_path)
  pngs = sorted(p.name for p in tmp_path.glob("*.png"))
  assert pngs == ["accuracy_vs_budget_niah_repeat_aware.png",
                  "heatmap_niah_repeat_aware_b64.png", "notes.png"]
  # A run that fails mid-way leaves no summary or plot of the earlier run.
  def fail(*args):
    raise FloatingPointError("boom")
  monkeypatch.setattr(runner, "_generate", fail)
  with pytest.raises(runner.EvalError):
    _run(lm, tmp_path, **{**NIAH, "budgets": (96,)})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.png", "results.jsonl"]


def test_a_failing_sample_is_named(lm, tmp_path, monkeypatch):
  def fail(*args):
    raise FloatingPointError("boom")
  monkeypatch.setattr(runner, "_generate", fail)
  with pytest.raises(runner.EvalError) as info:
    _run(lm, tmp_path, **NIAH)
  assert str(info.value) == ("sample 'niah-repeat-160-0.5-0-0' (niah, 160 tokens, depth 0.5, "
                             "repeat haystack) under full, snapkv (window=16) at budget 48: "
                             "FloatingPointError: boom")
  assert isinstance(info.value.__cause__, FloatingPointError)
  data = _write_jsonl(tmp_path / "d.jsonl", _facts(["a", "b"], ["x"] * 2))
  with pytest.raises(runner.EvalError, match=r"dataset .*d\.jsonl row 1 \(id '0', \d+ prompt"):
    _run(lm, tmp_path / "ds", dataset=str(data), **DATASET)


def test_reused_rows_are_counted_in_progress_and_summary(lm, tmp_path, capsys):
  first = _run(lm, tmp_path, **NIAH)
  assert (first.reused, first.ran) == (0, 2)
  assert "2 rows, 0 reused from an earlier run" in report.write_report(first, tmp_path)
  capsys.readouterr()
  again = _run(lm, tmp_path, progress=True, **NIAH)
  assert (again.reused, again.ran) == (2, 0) and list(again) == list(first)
  err = capsys.readouterr().err
  assert f"eval: 2 rows reused from {tmp_path / 'results.jsonl'}, 0 to run" in err
  assert "0run" not in err  # no empty progress bar
  text = report.write_report(again, tmp_path)
  assert text.splitlines()[2] == (f"2 rows, 2 reused from an earlier run "
                                  f"({tmp_path / 'results.jsonl'}), 0 run now.")


@pytest.mark.parametrize("fields, message", [
    (dict(budgets=(48, 48)), "--budgets repeats 48"),
    (dict(policies=("snapkv", "snapkv")), "--policies repeats snapkv"),
    (dict(budgets=(8,)), "budget 8 must exceed"),
])
def test_bad_runs_are_refused_before_any_work(lm, tmp_path, fields, message):
  with pytest.raises(ValueError, match=message):
    _run(lm, tmp_path, **{**NIAH, **fields})
  assert not (tmp_path / "results.jsonl").exists()


def test_one_budget_draws_a_bar_per_policy_full_first(monkeypatch, tmp_path):
  drawn = []
  monkeypatch.setattr(plots, "save", lambda fig, path: drawn.append(fig) or path)
  base = dict(model="m", task="niah", haystack="repeat", query_aware=True, prefill_chunk=0,
              length=1024, depth=0.5, metric="contains", policy_fields={})
  rows = [dict(base, policy=p, budget=b, correct=c, score=float(c))
          for p, b, c in (("full", None, True), ("snapkv", 64, True), ("knorm", 64, False))]
  report.plot_accuracy_vs_budget(rows, tmp_path)
  (ax,) = drawn[0].axes
  assert [t.get_text() for t in ax.get_xticklabels()] == ["full", "knorm", "snapkv"]
  assert [p.get_height() for p in ax.patches] == [100.0, 0.0, 100.0]
  assert not ax.get_lines()  # no reference line over the bars
  plots.pyplot().close(drawn[0])


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(rows=st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=20),
                                                max_size=3), min_size=1, max_size=5),
                  cut=st.floats(0, 1))
def test_a_file_cut_anywhere_reads_back_its_whole_rows(tmp_path_factory, rows, cut):
  path = tmp_path_factory.mktemp("cut") / "results.jsonl"
  with results.Appender(path) as appender:
    for row in rows:
      appender.append(row)
  data = path.read_bytes()
  at = int(cut * len(data))
  path.write_bytes(data[:at])
  loaded = results.read_rows(path)
  whole = data[:at].count(b"\n")
  assert loaded.rows == rows[:whole]
  assert loaded.torn_line == (None if at in (0, len(data)) or data[at - 1:at] == b"\n"
                              else whole + 1)
  if loaded.torn_line:
    results.drop_torn_line(path, loaded)
    assert path.read_bytes() == data[:data.rindex(b"\n", 0, at) + 1 if whole else 0]
    assert results.read_rows(path) == results.Loaded(rows[:whole], keep_bytes=len(path.read_bytes()))


def test_the_key_holds_the_sample_content_and_every_setting():
  head = dict(model="m", task="dataset", dataset="/d.jsonl", sample_sha256="x", id="0",
              length=64, depth=None, policy="snapkv", policy_fields={"window": 16},
              policy_settings={"window": 16, "kernel": 5, "group": "mean"}, budget=64,
              query_aware=True, prefill_chunk=0, packed=False, seed=0, max_new_tokens=8,
              metric="qa_f1")
  assert set(head) == set(results.KEY_FIELDS)
  for field in results.KEY_FIELDS:
    changed = dict(head, **{field: "other"})
    if field in ("policy_fields", "policy_settings"):
      changed[field] = dict(head[field], window=8)
    assert results.row_key(changed) != results.row_key(head), field
  # A default that changed (the same fields given, other settings) runs the row again.
  changed = dict(head, policy_settings=dict(head["policy_settings"], kernel=7))
  assert results.row_key(changed) != results.row_key(head)
  assert results.row_key(dict(head, prediction="p")) == results.row_key(head)
  digest = results.sample_sha256
  assert digest("c", "q", ["a"]) != digest("c", "q", ["b"]) != digest("c", "q2", ["b"])
  assert digest("c", "q", ["a"]) != digest("c", "q", ["a"], ["a", "b"])
