"""--policies entries with fields of their own, and the settings every row and summary names.

A tiny random model with SmolLM2's tokenizer runs the samples in seconds (as in
test_eval_resume.py): what is checked is which policy ran with which fields,
not its accuracy.
"""

import dataclasses

import pytest

import kvjax
from kvjax import policies
from kvjax.eval import policy_entries
from kvjax.eval import report
from kvjax.eval import results
from kvjax.eval import runner
from kvjax.models.tokenizer import Tokenizer

NIAH = dict(budgets=(48,), lengths=(160,), depths=(0.5,), haystacks=("repeat",),
            max_new_tokens=2)


@pytest.fixture(scope="module")
def lm(smollm2_path):
  tokenizer = Tokenizer.from_gguf(smollm2_path)
  config = kvjax.LlamaConfig(
      vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
      tie_embeddings=True)
  return dataclasses.replace(kvjax.init_random(config, seed=0), tokenizer=tokenizer)


@pytest.fixture
def ran(monkeypatch):
  """The (policy, budget) runs each generate_each call of the eval got, in order."""
  calls = []
  original = kvjax.generate_each

  def spy(lm, prompts, runs, **kwargs):
    calls.append(list(runs))
    return original(lm, prompts, runs, **kwargs)

  monkeypatch.setattr(kvjax, "generate_each", spy)
  return calls


# ------------------------------------------------------------------ parsing

@pytest.mark.parametrize("entry, name, fields", [
    ("full", "full", {}),
    ("paged_eviction:candidates=3", "paged_eviction", {"candidates": 3}),
    (" sablock : window=8 : gamma=0.5 ", "sablock", {"window": 8, "gamma": 0.5}),
    ("sablock:gamma=2", "sablock", {"gamma": 2.0}),  # an int where a float goes
    ("paged_eviction:per_head=true", "paged_eviction", {"per_head": True}),
    ("paged_eviction:per_head=FALSE", "paged_eviction", {"per_head": False}),
    ("paged_eviction:variant=v", "paged_eviction", {"variant": "v"}),
    ("snapkv:group=max:window=4", "snapkv", {"group": "max", "window": 4}),
])
def test_an_entry_parses_to_typed_fields(entry, name, fields):
  parsed = policy_entries.parse(entry)
  assert (parsed.name, dict(parsed.fields)) == (name, fields)
  for key, value in fields.items():  # types as the fields' own: 2 -> 2.0, not True -> 1
    got = getattr(parsed.make(0), key)
    assert got == value and type(got) is type(value), key


@pytest.mark.parametrize("raw, value", [
    ("3", 3), ("-2", -2), ("0.5", 0.5), ("1e3", 1000.0), ("true", True), ("False", False),
    ("mean", "mean"), ("", ""),
])
def test_values_parse_as_int_float_bool_then_str(raw, value):
  got = policy_entries.parse_value(raw)
  assert got == value and type(got) is type(value)


@pytest.mark.parametrize("entry, message", [
    ("", "an entry without a policy name"),
    (":window=3", "an entry without a policy name"),
    ("sablock:", "expected field=value after 'sablock', got ''"),
    ("sablock:window", "expected field=value after 'sablock', got 'window'"),
    ("sablock:=3", "got '=3'"),
    ("sablock:window=1:window=2", "sets window twice"),
    ("bogus:window=1", "unknown policy 'bogus'"),
    ("sablock:bogus=1", r"policy 'sablock' has no field\(s\) \['bogus'\]"),
    ("sablock:window=abc", "sablock's window takes an int, got 'abc'"),
    ("sablock:window=1.5", "sablock's window takes an int, got '1.5'"),
    ("paged_eviction:per_head=1", "per_head takes true or false, got '1'"),
    ("sablock:gamma=x", "gamma takes a number"),
    ("sablock:delimiter_ids=3", "delimiter_ids .a tuple. cannot be set on the command line"),
    ("paged_eviction:variant=bogus", r"'paged_eviction:variant=bogus'.*variant must be one of"),
    ("sablock:window=-1", "window must be"),
])
def test_a_bad_entry_is_a_value_error_naming_it(entry, message):
  with pytest.raises(ValueError, match=message):
    policy_entries.parse(entry)


def test_repeated_entries_are_refused_different_fields_are_not():
  parse_all = policy_entries.parse_all
  with pytest.raises(ValueError, match=r"^--policies repeats snapkv$"):
    parse_all(["snapkv", "snapkv"])
  with pytest.raises(ValueError, match=r"repeats sablock \(gamma=2.0, window=4\) \(sablock:"
                                       r"window=4:gamma=2 and sablock:gamma=2.0:window=4\)"):
    parse_all(["sablock:window=4:gamma=2", "sablock:gamma=2.0:window=4"])
  # With --window=16, "sablock" runs with window=16 as "sablock:window=16" does.
  with pytest.raises(ValueError, match=r"repeats sablock \(window=16\) \(sablock and "
                                       r"sablock:window=16 with --window=16\)"):
    parse_all(["sablock", "sablock:window=16"], window=16)
  entries = parse_all(["sablock", "sablock:window=16", "sablock:window=8"])
  assert [e.run_fields(0) for e in entries] == [{}, {"window": 16}, {"window": 8}]


def test_window_sets_every_window_an_entry_does_not():
  entries = policy_entries.parse_all(["snapkv", "snapkv:window=4", "h2o", "knorm"], window=8)
  assert [e.run_fields(8) for e in entries] == [{"window": 8}, {"window": 4}, {"recent": 8}, {}]
  assert [policy_entries.label(e.name, e.run_fields(8)) for e in entries] == [
      "snapkv (window=8)", "snapkv (window=4)", "h2o (recent=8)", "knorm"]


def test_settings_hold_every_field_and_count_the_tokenizers_delimiters(lm):
  policy = policies.get("sablock", gamma=0.5).bind(lm.tokenizer)
  settings = policy_entries.settings(policy, {"gamma"})
  assert list(settings) == [f.name for f in dataclasses.fields(policy)]
  assert settings["gamma"] == 0.5 and settings["window"] == policies.get("sablock").window
  assert settings["delimiter_ids"] == f"tokenizer ({len(policy.delimiter_ids)} ids)"
  assert len(policy.delimiter_ids) > 0
  assert policy_entries.settings(policies.get("full")) == {}
  assert policy_entries.settings_text({"per_head": False, "gamma": 0.5}) == (
      "per_head=false, gamma=0.5")


def test_eval_config_refuses_bad_entries_before_any_work(lm, tmp_path):
  for entries, message in ((("full", "sablock:window=x"), "takes an int"),
                           (("sablock", "sablock"), "--policies repeats sablock")):
    with pytest.raises(ValueError, match=message):
      runner.run(runner.EvalConfig(policies=entries, **NIAH), tmp_path, progress=False, lm=lm)
  assert not (tmp_path / "results.jsonl").exists()
  # A budget one entry's fields cannot honour is refused naming the entry.
  with pytest.raises(ValueError, match=r"^sablock \(window=48\): budget 48 must exceed"):
    runner.run(runner.EvalConfig(policies=("sablock", "sablock:window=48"), **NIAH), tmp_path,
               progress=False, lm=lm)
  assert not (tmp_path / "results.jsonl").exists()


# ------------------------------------------------------------------ runs, rows, summary

def test_each_policy_runs_at_its_defaults_and_rows_record_its_settings(lm, tmp_path, ran):
  cfg = runner.EvalConfig(policies=("full", "sablock", "paged_eviction"), **NIAH)
  assert cfg.window == 0
  rows = runner.run(cfg, tmp_path, progress=False, lm=lm)
  (runs,) = ran  # the policies as they reached generate_each, bound to the tokenizer
  full, sablock, paged = [policy for policy, _ in runs]
  assert sablock == policies.get("sablock").bind(lm.tokenizer) and sablock.delimiter_ids
  assert paged == policies.get("paged_eviction")
  assert [(r["policy"], r["policy_fields"]) for r in rows] == [
      ("full", {}), ("sablock", {}), ("paged_eviction", {})]
  settings = [r["policy_settings"] for r in rows]
  assert settings[0] == {}
  # No --window: SABlock keeps its own window (16), PagedEviction its 0.
  assert settings[1]["window"] == 16 and settings[2]["window"] == 0
  assert settings[1]["delimiter_ids"] == f"tokenizer ({len(sablock.delimiter_ids)} ids)"
  assert settings[1] == policy_entries.settings(sablock)
  assert settings[2] == policy_entries.settings(paged)
  text = report.write_report(rows, tmp_path)
  table, section = text.split("## Settings")
  assert "| sablock | " in table and "(window=" not in table
  lines = section.splitlines()
  assert "| full | no fields |" in lines
  assert f"| sablock | {policy_entries.settings_text(settings[1])} |" in lines
  assert f"| paged_eviction | {policy_entries.settings_text(settings[2])} |" in lines
  assert "delimiter_ids=tokenizer (" in section and text.endswith("\n")


def test_one_policy_twice_with_other_fields(lm, tmp_path, ran):
  cfg = runner.EvalConfig(policies=("paged_eviction", "paged_eviction:candidates=3"), **NIAH)
  rows = runner.run(cfg, tmp_path, progress=False, lm=lm)
  (runs,) = ran
  assert [policy for policy, _ in runs] == [policies.get("paged_eviction"),
                                           policies.get("paged_eviction", candidates=3)]
  assert [r["policy_fields"] for r in rows] == [{}, {"candidates": 3}]
  assert [r["policy_settings"]["candidates"] for r in rows] == [0, 3]
  assert len({results.row_key(r) for r in rows}) == 2  # two rows, two keys
  text = report.write_report(rows, tmp_path)
  table, section = text.split("## Settings")
  assert "| paged_eviction | " in table and "| paged_eviction (candidates=3) | " in table
  assert (f"| paged_eviction (candidates=3) | page_size={rows[1]['policy_settings']['page_size']}"
          f", variant=v_over_k, per_head=false, candidates=3, window=0 |") in section.splitlines()
  # A rerun with one entry of the two reuses its row and runs nothing.
  again = runner.run(dataclasses.replace(cfg, policies=("paged_eviction:candidates=3",)),
                     tmp_path, progress=False, lm=lm)
  assert (again.reused, again.ran) == (1, 0) and again[0] == rows[1]


def test_entry_fields_win_over_window(lm, tmp_path, ran):
  cfg = runner.EvalConfig(policies=("snapkv", "snapkv:window=4"), window=8, **NIAH)
  rows = runner.run(cfg, tmp_path, progress=False, lm=lm)
  (runs,) = ran
  assert [policy for policy, _ in runs] == [policies.get("snapkv", window=8),
                                           policies.get("snapkv", window=4)]
  assert [r["policy_fields"] for r in rows] == [{"window": 8}, {"window": 4}]
  assert [r["policy_settings"]["window"] for r in rows] == [8, 4]
  table, section = report.summary_markdown(rows).split("## Settings")
  for label in ("snapkv (window=8)", "snapkv (window=4)"):
    assert f"| {label} | " in table, label
    assert any(line.startswith(f"| {label} | window=") for line in section.splitlines()), label


def test_two_entries_of_a_policy_are_two_lines_everywhere(monkeypatch, tmp_path):
  base = dict(model="m", task="niah", haystack="repeat", query_aware=True, prefill_chunk=0,
              depth=0.5, metric="contains", budget=64)
  rows = []
  for length in (1024, 2048):
    rows += [dict(base, length=length, policy="paged_eviction", policy_fields={},
                  policy_settings={"candidates": 0}, correct=True, score=1.0),
             dict(base, length=length, policy="paged_eviction",
                  policy_fields={"candidates": 3}, policy_settings={"candidates": 3},
                  correct=False, score=0.0)]
  text = report.summary_markdown(rows)
  assert "| paged_eviction | 100% (1) |" in text
  assert "| paged_eviction (candidates=3) | 0% (1) |" in text
  # The depth x length tables and the plots keep the two apart too.
  heading = "## niah, repeat haystack, query-aware, one-shot prefill: paged_eviction"
  assert f"{heading} at budget 64, depth × length" in text
  assert f"{heading} (candidates=3) at budget 64, depth × length" in text
  assert text.split("## Settings")[1].count("| paged_eviction") == 2
  drawn = []
  from kvjax import plots
  monkeypatch.setattr(plots, "save", lambda fig, path: drawn.append(fig) or path)
  report.plot_heatmaps(rows, tmp_path)
  report.plot_accuracy_vs_budget(rows, tmp_path)
  heatmap, curve = drawn
  assert [ax.get_title() for ax in heatmap.axes if ax.get_title()] == [
      "paged_eviction", "paged_eviction (candidates=3)"]
  labels = {t.get_text() for ax in curve.axes for t in ax.get_xticklabels()}
  labels |= {t.get_text() for ax in curve.axes if ax.get_legend()
             for t in ax.get_legend().get_texts()}
  assert {"paged_eviction", "paged_eviction (candidates=3)"} <= labels
  for fig in drawn:
    plots.pyplot().close(fig)


def test_rows_without_settings_say_so():
  row = dict(model="m", task="niah", haystack="repeat", query_aware=True, prefill_chunk=0,
             length=64, depth=0.5, metric="contains", policy="snapkv", budget=64,
             policy_fields={"window": 16}, correct=True, score=1.0)
  text = report.summary_markdown([row])
  assert "| snapkv (window=16) | not recorded |" in text
