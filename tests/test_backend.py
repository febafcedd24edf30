"""Tests for kvjax.backend: one ambient switch, "auto" per op from measurements (a
measured-choices file where one is named, else the committed table)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from unittest import mock
import warnings

import jax
import pytest

from kvjax import backend as backend_lib
from kvjax import backend_choices
from kvjax import execution
from kvjax import paths
from kvjax.kernels import native
from kvjax.kernels import platform as platform_lib


@pytest.fixture
def fresh_native(monkeypatch):
  """Forgets whether the native kernels built, and which failures were warned about."""
  backend_lib._native_error.cache_clear()
  backend_lib._warn_native_unavailable.cache_clear()
  yield
  backend_lib._native_error.cache_clear()
  backend_lib._warn_native_unavailable.cache_clear()


def test_every_choice_names_a_real_implementation_and_its_reason():
  for (platform, op), choice in backend_choices.AUTO_CHOICES.items():
    assert platform in ("cpu", "gpu", "tpu"), platform
    assert op in backend_lib.ops(), op
    assert choice.backend in backend_lib._OPS[op], (platform, op, choice)
    assert choice.why and choice.why != "not measured", (platform, op)
    # The interpreter is never the fast side; native kernels run only on CPU.
    assert not (platform == "cpu" and choice.backend == "pallas"), (platform, op)
    assert not (platform != "cpu" and choice.backend == "native"), (platform, op)


def test_unmeasured_pairs_run_xla():
  assert backend_choices.auto_choice("tpu", "paged_attention") == backend_choices.NOT_MEASURED
  assert backend_choices.NOT_MEASURED.backend == "xla"


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_auto_on_accelerators_follows_the_table(platform):
  ex = execution.create("auto", platform=platform)
  for op in backend_lib.ops():
    want = backend_choices.auto_choice(platform, op).backend
    assert backend_lib.resolve("auto", op, platform=platform) == want, op
    assert ex.choice(op) == want, op
  # The H200 measured XLA faster for paged decode attention.
  assert backend_choices.auto_choice("gpu", "paged_attention").backend == "xla"


def test_auto_resolves_per_op_in_the_ambient_backend():
  with backend_lib.use("auto"):
    assert backend_lib.current() == "auto"
    for op in backend_lib.ops():
      assert backend_lib.get(op) is backend_lib._OPS[op][backend_lib.resolve("auto", op)]
  # On a CPU: the segmentation ops on XLA, paged attention native where it builds.
  with backend_lib.use("auto"):
    assert backend_lib.get("segment_ids") is backend_lib._OPS["segment_ids"]["xla"]
    want = "native" if backend_lib.native_available() else "xla"
    assert backend_lib.get("paged_attention") is backend_lib._OPS["paged_attention"][want]


def test_no_second_mechanism():
  assert not hasattr(backend_lib, "paged_attention_fn")
  assert not hasattr(backend_lib, "register_paged_attention")


def test_an_unwritable_cache_folder_leaves_auto_on_xla_with_one_warning(fresh_native, monkeypatch):
  monkeypatch.setattr(native, "load", mock.Mock(side_effect=PermissionError("read-only")))
  with pytest.warns(UserWarning, match="native CPU kernels unavailable.*read-only") as seen:
    assert backend_lib.resolve("auto", "paged_attention") == "xla"
    assert backend_lib.resolve("auto", "causal_attention") == "xla"
    assert backend_lib.native_available() is False
  assert len(seen) == 1
  assert native.load.call_count == 1  # tried once per process
  with pytest.raises(backend_lib.NativeUnavailable, match="cannot run here.*read-only"):
    backend_lib.resolve("native")


# A fresh interpreter: the kernels are built (or loaded) once per process.
_NATIVE_IN_FRESH_PROCESS = """
import warnings
from kvjax import backend
with warnings.catch_warnings(record=True) as seen:
  warnings.simplefilter("always")
  auto = [backend.resolve("auto", op) for op in ("paged_attention", "causal_attention")]
print(auto, len(seen))
try:
  backend.resolve("native")
except backend.NativeUnavailable as e:
  print("NativeUnavailable:", str(e).splitlines()[0])
"""


def _fresh(tmp_path, **env) -> list[str]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
  env.pop(backend_lib.NATIVE_ENV, None)
  done = subprocess.run([sys.executable, "-c", _NATIVE_IN_FRESH_PROCESS], capture_output=True,
                        text=True, env=env, cwd=tmp_path, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]  # no traceback
  return done.stdout.strip().splitlines()


def test_a_cache_folder_under_a_file_falls_back_in_a_fresh_process(tmp_path):
  (tmp_path / "a_file").write_text("")
  lines = _fresh(tmp_path, KVJAX_CACHE_DIR=str(tmp_path / "a_file" / "cache"))
  assert lines[0] == "['xla', 'xla'] 1"
  assert lines[1].startswith("NativeUnavailable: backend 'native' cannot run here: cannot build")


def test_no_compiler_falls_back_under_auto_and_explains_when_forced(tmp_path):
  lines = _fresh(tmp_path, KVJAX_CACHE_DIR=str(tmp_path / "cache"),
                 CXX=str(tmp_path / "no-such-compiler"))
  assert lines[0] == "['xla', 'xla'] 1"
  assert "no-such-compiler" in lines[1] and "does not run" in lines[1]


# ------------------------------------------------------------------ measured choices


@pytest.fixture
def unnamed(tmp_path, monkeypatch):
  """No measured-choices file named, a fresh cache folder, files read again."""
  monkeypatch.delenv(backend_choices.CHOICES_ENV, raising=False)
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
  backend_choices.forget_measured()
  yield tmp_path
  backend_choices.forget_measured()


def _entry(platform="cpu", **seconds) -> dict:
  return backend_choices.measured_entry([{"shape": "toy", "seconds": seconds}],
                                        platform=platform, command="a test")


def _write(path, entries, kind="a chip", platform="cpu"):
  return backend_choices.write_measured(path, kind, platform, entries)


def _table(platform: str, op: str) -> backend_choices.Choice:
  return backend_choices.AUTO_CHOICES.get((platform, op), backend_choices.NOT_MEASURED)


def _decisions(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.name == "kvjax"]


def test_the_faster_eligible_implementation_is_measured_best():
  assert _entry(xla=2e-3, fused=1e-3)["backend"] == "fused"
  assert _entry(xla=1e-3, fused=1e-3)["backend"] == "xla"  # a tie: the reference
  assert _entry(xla=2e-3, pallas=1e-3)["backend"] == "xla"  # a CPU's Pallas: the interpreter
  assert _entry("gpu", xla=2e-3, pallas=1e-3)["backend"] == "pallas"
  assert _entry("gpu", xla=2e-3, pallas=None)["backend"] == "xla"  # failed: not a candidate
  assert _entry("gpu", pallas=None) is None
  # Over shapes: the smallest geometric mean (xla 2 ms, pallas 1.73 ms).
  timings = [{"shape": "a", "seconds": {"xla": 1.0, "pallas": 2.0}},
             {"shape": "b", "seconds": {"xla": 4.0, "pallas": 1.5}}]
  entry = backend_choices.measured_entry(timings, platform="gpu", command="c")
  assert entry["backend"] == "pallas" and entry["timings"] == timings
  assert entry["jax_version"] == jax.__version__ and entry["command"] == "c"
  assert len(entry["date"]) == 10


def test_a_named_file_decides_auto_and_the_first_decision_is_logged(unnamed, caplog):
  caplog.set_level(logging.INFO, logger="kvjax")
  path = _write(unnamed / "choices.json", {"causal_attention": _entry(xla=2e-3, fused=1e-3)})
  doc = json.loads(path.read_text())
  assert (doc["format"], doc["device_kind"], doc["platform"]) == (1, "a chip", "cpu")
  # Unnamed, the table decides: the file sits there unread.
  assert backend_choices.auto_choice("cpu", "causal_attention") == _table("cpu",
                                                                          "causal_attention")
  assert _decisions(caplog) == []
  for _ in range(2):
    assert backend_choices.auto_choice("cpu", "causal_attention", path).backend == "fused"
    assert backend_lib.resolve("auto", "causal_attention", platform="cpu",
                               choices=path) == "fused"
  assert execution.create("auto", platform="cpu", choices=path).choice(
      "causal_attention") == "fused"
  (logged,) = _decisions(caplog)  # once per file
  assert str(path) in logged and "a chip" in logged and "causal_attention: fused" in logged
  why = backend_choices.auto_choice("cpu", "causal_attention", path).why
  assert "xla 2 ms, fused 1 ms" in why and str(path) in why
  # Ops the file does not name: the table, where unmeasured pairs are XLA.
  assert backend_choices.auto_choice("cpu", "paged_attention", path) == _table(
      "cpu", "paged_attention")
  assert backend_choices.auto_choice("cpu", "window_scores", path) == (
      backend_choices.NOT_MEASURED)
  # Another platform (a program built for a chip it was not measured on) never reads it.
  assert backend_choices.auto_choice("gpu", "causal_attention", path) == (
      backend_choices.NOT_MEASURED)
  # A new measurement replaces the file; it is read again (and logged again) when told.
  _write(path, {"paged_attention": _entry(xla=1e-3, pallas=2e-3)})
  assert backend_choices.auto_choice("cpu", "causal_attention", path).backend == "fused"
  backend_choices.forget_measured()
  assert backend_choices.auto_choice("cpu", "paged_attention", path).backend == "xla"
  assert backend_lib.resolve("auto", "paged_attention", platform="cpu",
                             choices=path) == "xla"  # not native, as measured
  assert backend_choices.auto_choice("cpu", "causal_attention", path) == _table(
      "cpu", "causal_attention")
  assert len(_decisions(caplog)) == 2


def test_the_environment_names_a_file_and_the_argument_wins(unnamed, monkeypatch, caplog):
  caplog.set_level(logging.INFO, logger="kvjax")
  fused = _write(unnamed / "fused.json", {"causal_attention": _entry(xla=2e-3, fused=1e-3)})
  xla = _write(unnamed / "xla.json", {"causal_attention": _entry(xla=1e-3, fused=2e-3)})
  monkeypatch.setenv(backend_choices.CHOICES_ENV, str(fused))
  assert backend_choices.auto_choice("cpu", "causal_attention").backend == "fused"
  assert backend_lib.resolve("auto", "causal_attention", platform="cpu") == "fused"
  assert backend_choices.auto_choice("cpu", "causal_attention", xla).backend == "xla"
  assert [str(fused) in m for m in _decisions(caplog)] == [True, False]
  monkeypatch.setenv(backend_choices.CHOICES_ENV, "")  # an empty variable names none
  assert backend_choices.auto_choice("cpu", "causal_attention") == _table("cpu",
                                                                          "causal_attention")


def test_without_a_name_the_table_decides_even_beside_a_cache_folder_file(unnamed, caplog):
  # Where the preset once installed its measurements: this device kind's file.
  caplog.set_level(logging.INFO, logger="kvjax")
  for kind in (jax.devices()[0].device_kind, "cpu"):
    everything = {op: _entry(xla=2e-3, fused=1e-3) for op in backend_lib.ops()}
    _write(paths.cache_dir() / "auto" / f"{kind}.json", everything, kind=kind)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for op in backend_lib.ops():
      assert backend_choices.auto_choice("cpu", op) == _table("cpu", op)
  assert execution.create("auto", platform="cpu").choice("causal_attention") != "fused"
  assert _decisions(caplog) == []


@pytest.mark.parametrize("content, error", [
    ("{not json", "Expecting property name"), ("[]", "not a format-1"),
    ('{"format": 2, "ops": {}}', "not a format-1"),
    ({"format": 1, "ops": {}}, "no 'device_kind' and 'platform'"),
    ({"format": 1, "device_kind": "a chip", "platform": "cpu"}, "no 'ops' object"),
    ({"format": 1, "device_kind": "a chip", "platform": "cpu",
      "ops": {"paged_attention": {"backend": "pallas", "timings": [], "jax_version": "0",
                                  "date": "d", "command": "c"}}},
     "'pallas' cannot run under auto on cpu"),
    ({"format": 1, "device_kind": "a chip", "platform": "cpu",
      "ops": {"causal_attention": {"backend": "fused"}}}, "malformed entry"),
], ids=["json", "list", "format", "device_kind", "ops", "interpreter", "entry"])
def test_a_bad_named_file_raises_what_is_wrong(unnamed, content, error):
  path = unnamed / "bad.json"
  path.write_text(content if isinstance(content, str) else json.dumps(content))
  with pytest.raises(ValueError, match=f"{path}.*unusable: .*{error}"):
    backend_choices.auto_choice("cpu", "paged_attention", path)


def test_a_named_file_that_is_missing_raises(unnamed, monkeypatch):
  missing = unnamed / "missing.json"
  monkeypatch.setenv(backend_choices.CHOICES_ENV, str(missing))
  with pytest.raises(FileNotFoundError, match=f"cannot read .*{missing}.*KVJAX_AUTO_CHOICES"):
    backend_choices.auto_choice("cpu", "paged_attention")
