"""`python -m kvjax.bench --preset=accelerator` at its small (CPU) scale: rows, files, table.

No timing assertions: on CPU the preset checks that every section runs.
"""

import dataclasses
import json
import subprocess
import sys

import pytest

from kvjax.bench import accelerator
from kvjax.bench import runner

COMMON = ("section", "label", "impl", "status", "error", "device_kind", "platform", "scale",
          "elapsed_s")
TIMED = ("value", "unit", "seconds", "bytes", "flops", "floor_s", "floor", "floor_bound",
         "of_floor")


def test_small_preset_writes_every_section(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--preset=accelerator", f"--out={tmp_path}"],
      capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert {r["section"] for r in rows} == set(accelerator.SECTIONS)
  for r in rows:
    assert all(f in r for f in COMMON), r
    assert r["scale"] == "small" and r["platform"] == "cpu" and r["scan_layers"] is True
    assert r["status"] == "ok", r
    if r["section"] != "equality":
      assert all(f in r for f in TIMED), r
      assert r["value"] > 0 and r["seconds"] > 0 and r["bytes"] > 0 and r["flops"] > 0
      assert r["floor"] is None  # a CPU is not in SPECS
  kernel = [r["impl"] for r in rows if r["section"] == "kernel"]
  assert kernel == ["xla", "pallas", kernel[2], "dense sdpa"] and kernel[2].startswith("auto (")
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
  none = accelerator.floor_fields(None, 1.0, 1.0, 1.0, lambda t: t)
  assert none["floor"] is None and none["of_floor"] is None and none["bytes"] == 1


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
