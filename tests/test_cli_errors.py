"""The command lines: --help lists each tool's flags; bad input ends in one line and exit 2.

Most cases call a tool's ``main`` in this process, through ``kvjax.cli`` as
its console script does (flags parsed by ``cli._parse_flags``, errors
answered by ``cli.call``). A few run the tools as subprocesses: --help and
Ctrl-C, which only a real process shows.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from absl import flags

from kvjax import backend
from kvjax import cli

FLAGS = flags.FLAGS
EVAL, BENCH = "kvjax.eval.main", "kvjax.bench.main"

# Both tools define --model, --policies, ... : absl holds one tool's flags at a time.
_TOOL_FLAGS: dict[str, dict] = {}
_ACTIVE: list[str] = []


def _tool(name: str):
  """The tool's module, its flags (and only its) registered."""
  if _ACTIVE == [name]:
    return sys.modules[name]
  if _ACTIVE:
    for flag_name in _TOOL_FLAGS[_ACTIVE[0]]:
      delattr(FLAGS, flag_name)
    _ACTIVE.clear()
  if name in _TOOL_FLAGS:
    for flag_name, flag in _TOOL_FLAGS[name].items():
      FLAGS[flag_name] = flag
  else:
    importlib.import_module(name)
    _TOOL_FLAGS[name] = {f.name: f for f in FLAGS.get_flags_for_module(name)}
  _ACTIVE.append(name)
  return sys.modules[name]


def _call(name: str, *args: str, capsys) -> tuple[int, list[str]]:
  """Runs tool ``name`` with ``args``; returns (exit code, stderr lines)."""
  module = _tool(name)
  FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as info:
    cli.call(module.main, cli._parse_flags([name, *args]))
  return info.value.code, capsys.readouterr().err.strip().splitlines()


def _one_error(code: int, lines: list[str], *words: str) -> str:
  assert code == 2, lines
  errors = [l for l in lines if l.startswith("error: ")]
  assert len(errors) == 1, lines
  for word in words:
    assert word in errors[0], (word, errors[0])
  return errors[0]


@pytest.fixture
def model(monkeypatch, smollm2_lm):
  """kvjax.load returns the session's SmolLM2 (loaded once for every test)."""
  import kvjax
  monkeypatch.setattr(kvjax, "load", lambda *a, **k: smollm2_lm)
  return smollm2_lm


def _dataset(tmp_path: pathlib.Path, text: str) -> str:
  path = tmp_path / "rows.jsonl"
  path.write_text(text)
  return str(path)


# ------------------------------------------------------------ flags and folders

def _read_only_out(tmp_path: pathlib.Path) -> pathlib.Path:
  """A folder that cannot be written: read-only, or (as root, who ignores modes) under a file."""
  if os.geteuid() == 0:
    (tmp_path / "a_file").write_text("x")
    return tmp_path / "a_file" / "out"
  folder = tmp_path / "read_only"
  folder.mkdir()
  folder.chmod(0o500)
  return folder / "out"


@pytest.mark.parametrize("tool", [EVAL, BENCH])
def test_out_that_is_a_file_or_unwritable(tool, tmp_path, capsys):
  file = tmp_path / "results.txt"
  file.write_text("not a folder")
  _one_error(*_call(tool, f"--out={file}", capsys=capsys), "--out", "is a file")
  _one_error(*_call(tool, f"--out={_read_only_out(tmp_path)}", capsys=capsys),
             "--out", "not writable")


@pytest.mark.parametrize("tool, args, words", [
    (EVAL, ["--query_aware=maybe"], ["query_aware", "maybe"]),
    (EVAL, ["--num_samples=-1"], ["--num_samples must be >= 0"]),
    (EVAL, ["--budgets=abc"], ["--budgets must be a comma list of ints"]),
    (EVAL, ["--depths=2"], ["--depths must lie in [0, 1]"]),
    (EVAL, ["--lengths=0"], ["--lengths must be positive"]),
    (EVAL, ["--budgets=4096", "--lengths=2048"], ["--budgets 4096", "whole prompts"]),
    (EVAL, ["--task=dataset"], ["--dataset goes with --task=dataset"]),
    (EVAL, ["--max_new_tokens=x"], ["max_new_tokens"]),
    (BENCH, ["--isolate=maybe"], ["isolate", "maybe"]),
    (BENCH, ["--batch_size=0"], ["--batch_size must be >= 1"]),
    (BENCH, ["--window=-1"], ["--window must be >= 0"]),
    (BENCH, ["--context_lengths=1,-5"], ["--context_lengths must be positive"]),
    (BENCH, [f"--context_lengths={10**12}"], ["int32"]),
    (BENCH, ["--budget=5000", "--context_lengths=4096"], ["--budget 5000", "whole context"]),
    (BENCH, ["--policies=full,nope"], ["unknown policy 'nope'"]),
    # --policies entries with fields of their own: name:field=value[:field=value...]
    (EVAL, ["--policies=full,sablock:window=abc"], ["'sablock:window=abc'",
                                                    "sablock's window takes an int"]),
    (EVAL, ["--policies=paged_eviction:nope=1"], ["policy 'paged_eviction' has no field(s) "
                                                  "['nope']"]),
    (EVAL, ["--policies=sablock:window"], ["expected field=value"]),
    (EVAL, ["--policies=snapkv,snapkv"], ["--policies repeats snapkv"]),
    (EVAL, ["--window=16", "--policies=sablock,sablock:window=16"],
     ["--policies repeats sablock (window=16)", "with --window=16"]),
    (BENCH, ["--policies=full,paged_eviction:per_head=yes"], ["per_head takes true or false"]),
    (BENCH, ["--policies=full,full"], ["--policies repeats full"]),
    # --preset=serving: every flag is checked before the model loads
    (BENCH, ["--preset=serving", "--serving_requests=0"], ["--serving_requests must be >= 1"]),
    (BENCH, ["--preset=serving", "--serving_max_slots=0"], ["--serving_max_slots must be >= 1"]),
    (BENCH, ["--preset=serving", "--serving_max_tokens=-1"],
     ["--serving_max_tokens must be >= 0"]),
    (BENCH, ["--preset=serving", "--serving_rate=0"], ["--serving_rate must be > 0"]),
    (BENCH, ["--preset=serving", "--serving_rate=nan"], ["--serving_rate must be > 0"]),
    (BENCH, ["--preset=serving", "--serving_pool=0.5"], ["--serving_pool must be >= 1"]),
    (BENCH, ["--preset=serving", "--serving_pool=2", "--kv_memory=1GiB"],
     ["one of --serving_pool and --kv_memory"]),
    (BENCH, ["--preset=serving", "--kv_memory=lots"], ["--kv_memory", "'lots'"]),
    (BENCH, ["--preset=serving", "--serving_task=qa"], ["serving_task", "passkey"]),
    (BENCH, ["--preset=serving", "--serving_policies=full,snapkv"],
     ["--serving_policies entry 'snapkv'", "needs a budget"]),
    (BENCH, ["--preset=serving", "--serving_policies=full:512"], ["budget must be None"]),
    (BENCH, ["--preset=serving", "--serving_policies=snapkv:x"], ["expected a budget"]),
    (BENCH, ["--preset=serving", "--serving_policies=snapkv:512,snapkv:512"],
     ["--serving_policies repeats snapkv @ 512"]),
    (BENCH, ["--preset=serving", "--serving_policies=snapkv:5000"],
     ["budget 5000", "--serving_prompt_tokens 4096"]),
])
def test_bad_flag_values(tool, args, words, tmp_path, capsys):
  _one_error(*_call(tool, f"--out={tmp_path}", *args, capsys=capsys), *words)
  assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("tool, args, words", [
    (EVAL, ["--policies=full,sablock:window=200", "--budgets=128", "--lengths=512"],
     ["sablock (window=200): budget 128 must exceed"]),
    (BENCH, ["--policies=sablock:window=2000", "--budget=1024", "--fill=synthetic"],
     ["sablock (window=2000) at budget 1024", "must exceed"]),
])
def test_a_budget_an_entry_cannot_honour_names_the_entry(tool, args, words, model, tmp_path,
                                                         capsys):
  _one_error(*_call(tool, f"--out={tmp_path}", *args, capsys=capsys), *words)
  assert not (tmp_path / "results.jsonl").exists()


def test_serving_prompts_too_short_for_the_task(model, tmp_path, capsys):
  _one_error(*_call(BENCH, f"--out={tmp_path}", "--preset=serving",
                    "--serving_policies=full", "--serving_prompt_tokens=20", capsys=capsys),
             "20 tokens is below")


@pytest.mark.parametrize("tool", [EVAL, BENCH])
def test_native_without_a_compiler(tool, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(backend, "_native_error", lambda: "no C++ compiler found (set $CXX)")
  _one_error(*_call(tool, f"--out={tmp_path}", "--backend=native", capsys=capsys),
             "--backend=native", "no C++ compiler")


def test_unknown_model_is_one_line(tmp_path, capsys):
  _one_error(*_call(EVAL, f"--out={tmp_path}", "--model=no-such-model", capsys=capsys),
             "'no-such-model' is not a file, a folder or a known model")


# ------------------------------------------------------------ eval inputs

@pytest.mark.parametrize("text, words", [
    ('{"context": "abc", "question": "q?", "answer": null}\n', ["line 1", "'answer'"]),
    ('{"context": "abc", "question": "q?", "answer": "a", "x": ' + "[" * 100_000
     + "]" * 100_000 + "}\n", ["line 1", "nested too deeply"]),
    ('{"context": "abc", "question": "q?"}\n', ["lacks", "answer"]),
    ("not json\n", ["not a JSON line"]),
])
def test_bad_dataset_rows(text, words, model, tmp_path, capsys):
  path = _dataset(tmp_path, text)
  _one_error(*_call(EVAL, f"--out={tmp_path / 'out'}", "--task=dataset", f"--dataset={path}",
                    "--policies=full", capsys=capsys), path, *words)


def test_absurd_length(model, tmp_path, capsys):
  _one_error(*_call(EVAL, f"--out={tmp_path}", f"--lengths={10**12}", "--policies=full",
                    capsys=capsys), "exceeds the model's context")


def test_mid_run_error_names_the_sample(model, tmp_path, monkeypatch, capsys):
  from kvjax.eval import runner

  def broken(*args, **kwargs):
    raise FloatingPointError("NaN in the logits")
    yield  # pylint: disable=unreachable

  monkeypatch.setattr(runner, "_generate", broken)
  path = _dataset(tmp_path, '{"context": "The sky is green.", "question": "Sky colour?", '
                            '"answer": "green", "id": "sky"}\n')
  _one_error(*_call(EVAL, f"--out={tmp_path / 'out'}", "--task=dataset", f"--dataset={path}",
                    "--policies=full", capsys=capsys),
             "row 1", "'sky'", "full", "FloatingPointError", "NaN in the logits")


def test_eval_interrupted_says_how_many_rows_are_kept(model, tmp_path, monkeypatch, capsys):
  from kvjax.eval import runner
  out = tmp_path / "out"
  out.mkdir()
  (out / "results.jsonl").write_text('{"a": 1}\n{"a": 2}\n')

  def interrupted(cfg, out, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(runner, "run", interrupted)
  code, lines = _call(EVAL, f"--out={out}", "--policies=full", capsys=capsys)
  assert code == 130 and lines == [f"interrupted; 2 rows kept in {out}, rerun to resume"]


# ------------------------------------------------------------ bench: memory, failures

def test_memory_estimate_refuses_what_cannot_fit(model, tmp_path, capsys):
  for args in (["--batch_size=100000"], [f"--context_lengths={10**9}", "--fill=synthetic"],
               [f"--decode_steps={10**9}", "--context_lengths=64", "--budget=64"]):
    _one_error(*_call(BENCH, f"--out={tmp_path}", "--policies=full,snapkv:window=16", *args,
                      capsys=capsys), "needs an estimated", "more than the", "--batch_size")
  assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_prompt_past_the_model_context_is_refused_up_front(model, tmp_path, capsys):
  _one_error(*_call(BENCH, f"--out={tmp_path}", "--policies=full", "--fill=prompt",
                    "--context_lengths=9000", capsys=capsys),
             "full, 9000 tokens", "exceeds the model's context", "--fill=synthetic")


def _old_run(out: pathlib.Path) -> dict[str, str]:
  out.mkdir(exist_ok=True)
  files = {"results.jsonl": '{"old": 1}\n', "summary.md": "# old\n",
           "peak_memory.png": "old png"}
  for name, text in files.items():
    (out / name).write_text(text)
  return files


@pytest.mark.parametrize("error, words", [
    (FloatingPointError("NaN"), ["snapkv (window=16) at budget 32, 96 tokens",
                                 "FloatingPointError: NaN"]),
    (MemoryError(), ["MemoryError"]),
])
def test_failing_rerun_leaves_the_earlier_results(error, words, model, tmp_path, monkeypatch,
                                                  capsys):
  from kvjax.bench import runner
  out = tmp_path / "out"
  old = _old_run(out)
  calls = []

  def measure(cfg, lm=None):
    calls.append(cfg.policy)
    if cfg.policy == "snapkv":
      raise error
    return {"policy": cfg.policy}

  monkeypatch.setattr(runner, "measure", measure)
  _one_error(*_call(BENCH, f"--out={out}", "--isolate=false", "--policies=full,snapkv",
                    "--window=16", "--budget=32", "--context_lengths=96", capsys=capsys),
             *words)
  assert calls == ["full", "snapkv"]
  assert {name: (out / name).read_text() for name in old} == old  # untouched
  assert (out / "results.partial.jsonl").read_text() == '{"policy": "full"}\n'


def test_bench_interrupted(model, tmp_path, monkeypatch, capsys):
  from kvjax.bench import runner
  out = tmp_path / "out"
  old = _old_run(out)

  def measure(cfg, lm=None):
    raise KeyboardInterrupt

  monkeypatch.setattr(runner, "measure", measure)
  code, lines = _call(BENCH, f"--out={out}", "--isolate=false", "--policies=full",
                      "--context_lengths=96", capsys=capsys)
  assert code == 130 and lines[-1].startswith("interrupted; the earlier results"), lines
  assert all(l.startswith("bench: ") for l in lines[:-1]), lines  # the progress bar, closed
  assert {name: (out / name).read_text() for name in old} == old


def test_unexpected_error_is_one_line_with_its_type(capsys, monkeypatch):
  def main(argv):
    raise TypeError("unsupported operand")

  monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
  with pytest.raises(SystemExit) as info:
    cli.call(main, ["tool"])
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert info.value.code == 1
  assert line.startswith("error: internal error: TypeError: unsupported operand"), line
  monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
  with pytest.raises(TypeError):
    cli.call(main, ["tool"])


def test_every_flag_is_in_a_help_group():
  for name in (EVAL, BENCH):
    module = _tool(name)
    grouped = {f for _, names in module.HELP_GROUPS for f in names}
    own = {f.name for f in FLAGS.get_flags_for_module(name)} - {"child"}
    assert own <= grouped, (name, own - grouped)
    text = cli.help_text(module.main, module.HELP_GROUPS)
    assert "--child" not in text and "other:" not in text


# ------------------------------------------------------------ real processes

@pytest.mark.parametrize("tool, words", [
    ("kvjax.eval", ["what to run:", "prompts:", "--budgets=<a,b,...>", "Default: 128",
                    "--[no]query_aware", "--out=<string>"]),
    ("kvjax.bench", ["what to run:", "cache and decoding:", "--batch_size=<int>",
                     "--fill=<auto|prompt|synthetic>", "Default: results/bench"]),
])
def test_help_lists_the_tools_own_flags(tool, words):
  proc = subprocess.run([sys.executable, "-m", tool, "--help"], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  for word in words:
    assert word in proc.stdout, word
  assert "--logtostderr" not in proc.stdout  # absl's own flags only under --helpfull


def test_ctrl_c_ends_the_eval_with_130(tmp_path):
  out = tmp_path / "out"
  proc = subprocess.Popen(
      [sys.executable, "-m", "kvjax.eval", f"--out={out}", "--policies=full,streaming_llm",
       "--budgets=64", "--lengths=256", "--haystacks=repeat", "--depths=0.2,0.8", "--num_samples=10",
       "--max_new_tokens=4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      # A shell's background job starts with SIGINT ignored, and Python keeps an
      # ignored SIGINT ignored: the child gets the default back, as at a terminal.
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  deadline = time.monotonic() + 300
  results = out / "results.jsonl"
  while not (results.exists() and results.read_text()) and proc.poll() is None:
    assert time.monotonic() < deadline, "no row written"
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  kept = len(results.read_text().splitlines())
  assert proc.returncode == 130, stderr
  assert stderr.strip().splitlines()[-1] == (
      f"interrupted; {kept} rows kept in {out}, rerun to resume"), stderr
  assert "Traceback" not in stderr
