"""`python -m kvjax.bench --preset=accelerator` at its small (CPU) scale: rows, files, table.

No timing assertions: on CPU the preset checks that every section runs.
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from kvjax import backend
from kvjax import backend_choices
from kvjax import paths
from kvjax.bench import accelerator
from kvjax.bench import runner
from kvjax.bench.accelerator import scales
from kvjax.bench.accelerator import shapes

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMMON = ("section", "label", "impl", "status", "error", "device_kind", "platform", "scale",
          "elapsed_s")
TIMED = ("value", "unit", "seconds", "bytes", "flops", "floor_s", "floor", "floor_bound",
         "of_floor")
# A timed row's value from its other fields, by unit; the units each section reports in.
VALUE = {"GB/s": lambda r: r["bytes"] / r["seconds"] / 1e9,
         "TFLOP/s": lambda r: r["flops"] / r["seconds"] / 1e12,
         "ms/step": lambda r: 1e3 * r["seconds"],
         "tokens/s": lambda r: r["batch_size"] / r["seconds"],
         "s": lambda r: r["seconds"]}
UNITS = {"kernel": {"GB/s", "TFLOP/s"}, "decode": {"ms/step"}, "throughput": {"tokens/s"},
         "prefill": {"s"}}


def test_small_preset_writes_every_section(tmp_path, monkeypatch):
  env = {k: v for k, v in os.environ.items() if k != backend_choices.CHOICES_ENV}
  # A cache folder of its own, sharing the native kernels already built (seconds each).
  env[paths.CACHE_ENV] = str(tmp_path / "cache")
  (tmp_path / "cache").mkdir()
  (tmp_path / "cache" / "native").symlink_to(paths.cache_dir() / "native",
                                             target_is_directory=True)
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--preset=accelerator", f"--out={tmp_path}"],
      capture_output=True, text=True, timeout=900, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The measurement stays in the run's folder: nothing for later calls to find.
  assert not (tmp_path / "cache" / "auto").exists()
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert {r["section"] for r in rows} == set(accelerator.SECTIONS)
  for r in rows:
    assert all(f in r for f in COMMON), r
    assert r["scale"] == "small" and r["platform"] == "cpu" and r["scan_layers"] is True
    assert r["status"] == "ok", r
    if r["section"] != "equality":
      assert all(f in r for f in TIMED), r
      assert r["seconds"] > 0 and r["bytes"] > 0 and r["flops"] > 0, r
      assert r["unit"] in UNITS[r["section"]], r
      assert r["value"] == pytest.approx(VALUE[r["unit"]](r)), r
      # A CPU is not in SPECS: no floor.
      assert (r["floor_s"], r["floor"], r["floor_bound"], r["of_floor"]) == (None,) * 4, r
  # Every implementation per op (native CPU kernels take only float32), auto last.
  kernel = [r["impl"] for r in rows if r["section"] == "kernel"]
  assert kernel[:3] + kernel[4:6] == ["xla", "pallas", "dense sdpa", "xla", "fused"], kernel
  assert len(kernel) == 7 and kernel[3].startswith("auto (") and kernel[6].startswith("auto (")
  prompt = [r for r in rows if r["section"] == "kernel" and "causal prompt" in r["label"]]
  assert {r["unit"] for r in prompt} == {"TFLOP/s"}
  _check_choices(tmp_path, proc.stdout, monkeypatch)
  decode = [(r["policy"], r["backend"]) for r in rows if r["section"] == "decode"]
  assert decode == [(p, b) for p in ("full", "snapkv") for b in ("xla", "pallas", "auto")]
  assert [r["batch_size"] for r in rows if r["section"] == "throughput"] == [1, 2]
  assert [r["prefill_chunk"] for r in rows if r["section"] == "prefill"] == [0, 0, 128]
  equality = [r for r in rows if r["section"] == "equality"]
  assert [r["policy"] for r in equality] == list(accelerator.SMALL.equality_policies)
  for r in equality:
    assert r["equal"] is True and r["tokens_xla"] == r["tokens_pallas"], r
  summary = (tmp_path / "summary.md").read_text()
  for title in accelerator.TITLES.values():
    assert f"## {title}" in summary and f"## {title}" in proc.stdout
  assert "not run" not in summary and "| snapkv @ 48 | pallas vs xla | yes | 4 |" in summary
  assert "] decode     1,024 tokens, full cache | pallas | " in proc.stdout  # progress lines


def _check_choices(out, stdout, monkeypatch):
  """The run's auto_choices.json: per op the faster eligible implementation, with its
  figures; how to name it printed, and deciding "auto" only where named."""
  choices = out / "auto_choices.json"
  assert f"written to {choices}." in stdout
  assert f"export KVJAX_AUTO_CHOICES={choices}" in stdout
  assert "('cpu', 'causal_attention'): Choice(" in stdout
  assert "not to commit" in stdout  # toy sizes on a CPU
  doc = json.loads(choices.read_text())
  assert (doc["format"], doc["device_kind"], doc["platform"]) == (1, "cpu", "cpu")
  assert set(doc["ops"]) == {"paged_attention", "causal_attention"}
  for op, entry in doc["ops"].items():
    (timing,) = entry["timings"]
    seconds = timing["seconds"]
    assert set(seconds) == set(accelerator.implementations(op, jax.numpy.bfloat16))
    best = min((s, n) for n, s in seconds.items() if n != "pallas")[1]  # no interpreter
    assert entry["backend"] == best, entry
    assert entry["jax_version"] == jax.__version__
    assert entry["command"].endswith("--scale=small")
  # Named, they decide "auto" (xla or fused: a bfloat16 run times no native kernel).
  monkeypatch.setenv(backend_choices.CHOICES_ENV, str(choices))
  backend_choices.forget_measured()
  try:
    for op, entry in doc["ops"].items():
      assert backend_choices.auto_choice("cpu", op).backend == entry["backend"]
      assert backend.resolve("auto", op, platform="cpu") == entry["backend"]
  finally:
    backend_choices.forget_measured()


def _config_file(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("name", ["llama3_2_1b", "smollm2_135m"])
def test_the_shipped_shapes_are_the_configs_files(name):
  # The preset ships its shapes (it reads no repository file); configs/ states them too.
  assert shapes.SHAPES[name] == _config_file(ROOT / "configs" / f"{name}.py")
  assert accelerator.model_config(name) is shapes.SHAPES[name]
  assert accelerator.FULL.model in shapes.SHAPES
  assert accelerator.FULL.equality_model in shapes.SHAPES


def test_a_config_file_replaces_the_model(tmp_path):
  path = tmp_path / "two_layers.py"
  path.write_text("from kvjax.models.config import LlamaConfig\n\n"
                  "def get_config():\n"
                  "  return LlamaConfig(vocab_size=256, hidden_size=64, num_layers=1, "
                  "num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, "
                  "name='one layer')\n")
  assert accelerator.model_config(str(path)).name == "one layer"
  scale = dataclasses.replace(accelerator.SMALL, model=str(path))
  assert scales.command(scale) == f"{accelerator.COMMAND} --scale=small --config={path}"
  assert scales.command(accelerator.SMALL) == f"{accelerator.COMMAND} --scale=small"
  accelerator.run(tmp_path / "out", scale="small", sections=(), config=path)
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert f"--config={path}`" in summary and "random one layer shape (1 layers" in summary
  with pytest.raises(FileNotFoundError, match="neither a shape the preset ships"):
    accelerator.model_config("configs/llama3_2_1b")  # a name, not a file


def test_a_missing_config_file_exits_2(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "kvjax.bench", "--preset=accelerator",
                         f"--config={tmp_path / 'nope.py'}", f"--out={tmp_path}"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and f"--config: no file {tmp_path / 'nope.py'}" in proc.stderr


def test_table_lines_are_the_measured_choice_in_python():
  timings = [{"shape": "B=8 K=8 G=4 H=64, 32,768 slots, bfloat16",
              "seconds": {"xla": 2.5e-4, "pallas": 0.9e-4}},
             {"shape": "B=1 K=8 G=4 H=64, 32,768 slots, bfloat16",
              "seconds": {"xla": 1e-4, "pallas": None}}]
  entry = backend_choices.measured_entry(timings[:1], platform="gpu", command="cmd")
  entries = {"paged_attention": entry,
             "causal_attention": {**entry, "backend": "fused", "timings": timings}}
  lines = accelerator.table_lines("NVIDIA H200", "gpu", entries)
  assert max(len(l) for l in lines) <= 100
  source = "{" + "\n".join(lines) + "}"
  table = eval(source, {"Choice": backend_choices.Choice})  # pylint: disable=eval-used
  assert table == {
      ("gpu", op): backend_choices.Choice(e["backend"],
                                          backend_choices.why_measured("NVIDIA H200", e))
      for op, e in entries.items()}
  why = table["gpu", "causal_attention"].why
  assert why.startswith(f"NVIDIA H200, jax {jax.__version__}, {entry['date']}, `cmd`: B=8")
  assert "xla 0.25 ms, pallas 0.09 ms; B=1" in why and "pallas failed" in why


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H200", "NVIDIA H200 SXM"), ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"), ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"),
    ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"), ("TPU v5p", "TPU v5p"),
    ("TPU v6 lite", "TPU v6e"), ("NVIDIA H100 PCIe", None), ("cpu", None),
])
def test_device_spec_by_kind(kind, name):
  spec = accelerator.device_spec(kind)
  assert (spec and spec.name) == name


def test_floor_is_the_larger_bound():
  h200 = accelerator.device_spec("NVIDIA H200")
  row = accelerator.floor_fields(h200, 2e-3, 4.8e9, 1e9, lambda t: 1e3 * t)
  assert row["floor_bound"] == "bandwidth" and row["floor_s"] == pytest.approx(1e-3)
  assert row["floor"] == pytest.approx(1.0) and row["of_floor"] == pytest.approx(0.5)
  row = accelerator.floor_fields(h200, 1.0, 1.0, 989e12, lambda t: t)
  assert row["floor_bound"] == "compute" and row["floor_s"] == pytest.approx(1.0)
  assert row["floor"] == pytest.approx(1.0) and row["of_floor"] == pytest.approx(1.0)
  none = accelerator.floor_fields(None, 1.0, 1.0, 1.0, lambda t: t)
  assert none == {"bytes": 1, "flops": 1, "floor_s": None, "floor": None, "floor_bound": None,
                  "of_floor": None}


def test_failure_tells_out_of_memory_from_other_errors():
  oom = accelerator.failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB"))
  assert oom["status"] == "oom" and "9 GiB" in oom["error"]
  assert accelerator.failure(ValueError("bad\nshape"))["error"] == "ValueError: bad shape"
  assert accelerator.failure(ValueError("x"))["status"] == "error"


def test_a_failing_section_is_a_row(tmp_path, monkeypatch):
  def broken(*args):
    raise RuntimeError("lowering failed")
  monkeypatch.setattr(accelerator, "kernel_section", broken)
  rows = accelerator.run(tmp_path, scale="small", sections=("kernel",))
  assert [(r["section"], r["status"], r["error"]) for r in rows] == [
      ("kernel", "error", "RuntimeError: lowering failed")]
  summary = (tmp_path / "summary.md").read_text()
  assert "ERROR: RuntimeError: lowering failed" in summary and summary.count("not run") == 4


def test_throughput_stops_at_the_first_out_of_memory(tmp_path, monkeypatch):
  import kvjax
  def decode(lm, cfg, policy):
    if cfg.batch_size > 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    return {"decode_s": 1.0, "steps": 4, "compile_s": 0.0, "kv_bytes": 1}
  monkeypatch.setattr(runner, "synthetic_decode", decode)
  rec = accelerator.Recorder(tmp_path, {})
  scale = dataclasses.replace(accelerator.SMALL, batches=(1, 2, 4, 8))
  lm = kvjax.init_random(accelerator.model_config("tiny"))
  accelerator.throughput_section(rec, scale, None, lm)
  rec.close()
  assert [(r["label"].rsplit(" ", 1)[1], r["status"]) for r in rec.rows] == [
      ("1", "ok"), ("2", "ok"), ("4", "oom")]
  assert [r["value"] for r in rec.rows[:2]] == [4.0, 8.0]  # tokens/s: batch x steps / s
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_bad_section_exits_2(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "kvjax.bench", "--preset=accelerator",
                         "--sections=kernel,nope", f"--out={tmp_path}"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "--sections: unknown ['nope']" in proc.stderr
