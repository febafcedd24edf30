"""What ``"auto"`` runs, per platform and op, and the measurement each choice rests on.

``"auto"`` must never run a slower implementation than the one it passes
over, so it picks only what a measurement on that platform showed faster; a
pair without one runs XLA (the references, compiled by XLA for every
platform). ``auto_choice`` looks, in order, at:

  1. the measured choices of this machine's device kind:
     ``$KVJAX_CACHE_DIR/auto/<device kind>.json`` (``measured_path``), which
     ``python -m kvjax.bench --preset=accelerator`` writes on a GPU or TPU.
     Read once per process; a missing file is skipped silently, an unreadable
     or malformed one with one warning. Consulted only for the platform of
     this machine's default device: a program built for another one
     (``kvjax.kernels.platform.targeting``) is not for this device kind;
  2. ``AUTO_CHOICES`` below, the committed measurements (the preset prints an
     entry to paste here for each op it measured);
  3. XLA (``NOT_MEASURED``).

Each table entry names the figures and where they come from; a new
measurement changes the entry and its reason together.

The CPU's ``"native"`` choices hold only where the C++ kernels build
(``kvjax.backend.native_available``); elsewhere ``"auto"`` runs XLA. Pallas
never runs under ``"auto"`` on a CPU: no compiler there, only the interpreter.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import pathlib
import re
import warnings

import jax

from kvjax import paths


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation ``"auto"`` runs for one (platform, op), and why."""

  backend: str  # "xla", "pallas", "native" or another registered name ("fused")
  why: str  # the measurement (figures, machine, command or results file), or why none


NOT_MEASURED = Choice("xla", "not measured")

_PACKED_RUN = ("SmolLM2-135M Q4_1 packed, 2-core CPU; docs/results/vs_kvpress.md "
               "'Packed weights and native prompt kernels'")
_PAGED_ATTENTION_H200 = (
    "H200, bfloat16, jax 0.11.2, 2026-12: kernel alone (benchmarks/kernels/"
    "bench_paged_attention.py --dtype=bfloat16 --batch=8 --kv_heads=8 --group=4 "
    "--max_pages=2048) Pallas 0.52 TB/s, XLA 0.52 TB/s; decode step of the "
    "Llama-3.2-1B shape (configs/llama3_2_1b.py), full cache, batch 1: Pallas 11.6 ms, "
    "XLA 4.3 ms at 32K; Pallas 39.0 ms, XLA 8.2 ms at 128K")
_SCALAR_WALK = ("not timed on a device; the kernel is a sequential scalar walk, O(T) "
                "steps per sequence beside an O(T^2) prefill")

# (platform as jax.default_backend() names it, op) -> Choice. Pairs not listed: NOT_MEASURED.
AUTO_CHOICES: dict[tuple[str, str], Choice] = {
    ("cpu", "paged_attention"): Choice(
        "native", "whole decode steps 46.0-50.1 ms (XLA) -> 37.1-41.8 ms (native), SmolLM2 "
        "4K prompt, snapkv budget 1024, unrolled layers, 2-core CPU, 3 alternating rounds; "
        "docs/results/vs_kvpress.md"),
    ("cpu", "causal_attention"): Choice(
        "native", f"82 GFLOP/s against XLA's blockwise form's 45-52; {_PACKED_RUN}"),
    ("cpu", "quantized_matmul"): Choice(
        "native", "82-107 GFLOP/s reading the blocks in place; XLA's reference dequantizes "
        f"the whole matrix first, and its float32 GEMM alone runs at 81-117; {_PACKED_RUN}"),
    ("cpu", "dequantize"): Choice(
        "native", "timed as part of packed decoding (steps at budget 1024: 25-31 ms); "
        f"{_PACKED_RUN}"),
    ("gpu", "paged_attention"): Choice("xla", _PAGED_ATTENTION_H200),
    ("gpu", "segment_ids"): Choice("xla", _SCALAR_WALK),
    ("gpu", "dynamic_split"): Choice(
        "xla", "the Triton lowering refuses the kernel's arrays at lengths that are not "
        "powers of 2 (H200, jax 0.11.2: shape (1, 171) for a 2,047-token prompt); "
        + _SCALAR_WALK),
    ("tpu", "segment_ids"): Choice("xla", _SCALAR_WALK),
    ("tpu", "dynamic_split"): Choice("xla", _SCALAR_WALK),
}


def auto_choice(platform: str, op: str) -> Choice:
  """What ``"auto"`` runs for ``op`` on ``platform``: this device kind's measured
  choice, else the table's, else XLA (the module docstring)."""
  if platform == jax.default_backend():
    measured = _measured_here(platform)
    if op in measured:
      return measured[op]
  return AUTO_CHOICES.get((platform, op), NOT_MEASURED)


# ------------------------------------------------------------------ measured choices

FORMAT = 1  # the measured-choices file's layout (``write_measured``)


def eligible(platform: str, implementation: str) -> bool:
  """Whether ``"auto"`` may run ``implementation`` on ``platform`` at all: never the
  Pallas interpreter (a CPU's Pallas), and the native kernels only on a CPU."""
  if implementation == "pallas":
    return platform != "cpu"
  return implementation != "native" or platform == "cpu"


def device_slug(device_kind: str) -> str:
  """A file name for a ``device_kind``: "NVIDIA H200" -> "nvidia-h200"."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


def measured_path(device_kind: str) -> pathlib.Path:
  """Where the measured choices of a device kind live: ``<cache>/auto/<slug>.json``."""
  return paths.cache_dir() / "auto" / f"{device_slug(device_kind)}.json"


def measured_entry(timings: list[dict], *, platform: str, command: str) -> dict | None:
  """The choice for one op from its timings, or None when nothing eligible ran everywhere.

  Args:
    timings: one dict per shape timed, {"shape": str, "seconds": {implementation:
      seconds, or None where it failed}}.
    platform: where it was timed (``eligible`` decides the candidates).
    command: what measured it (recorded with the figures).

  Returns:
    {"backend", "timings", "jax_version", "date", "command"}: the
    eligible implementation that ran at every shape with the smallest geometric
    mean of its times (ties go to XLA, the reference), or None.
  """
  names = {n for t in timings for n in t["seconds"]}
  ran = [n for n in sorted(names) if eligible(platform, n)
         and all(t["seconds"].get(n) for t in timings)]
  if not ran:
    return None
  mean_log = lambda n: sum(math.log(t["seconds"][n]) for t in timings) / len(timings)
  best = min(ran, key=lambda n: (mean_log(n), n != "xla"))
  return {"backend": best, "timings": timings, "jax_version": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
          "command": command}


def write_measured(path: str | pathlib.Path, device_kind: str, platform: str,
                   entries: dict[str, dict], *, merge: bool = True) -> pathlib.Path:
  """Writes op -> ``measured_entry`` for a device kind as JSON; returns the path.

  With ``merge``, ops in an existing valid file that ``entries`` lacks are
  kept. The file is replaced whole (written beside it, then renamed), so a
  reader never sees half of it.
  """
  path = pathlib.Path(path)
  ops = {}
  if merge and path.exists():
    try:
      ops = _parse(path.read_text(), device_kind, platform)
    except (OSError, ValueError):
      ops = {}
  ops.update(entries)
  doc = {"format": FORMAT, "device_kind": device_kind, "platform": platform,
         "ops": dict(sorted(ops.items()))}
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + ".partial")
  partial.write_text(json.dumps(doc, indent=1) + "\n")
  partial.replace(path)
  return path


def why_measured(device_kind: str, entry: dict) -> str:
  """A table entry's reason from a measured entry: the device, versions and times."""
  times = "; ".join(
      t["shape"] + ": " + ", ".join(f"{n} {1e3 * s:.3g} ms" if s else f"{n} failed"
                                    for n, s in t["seconds"].items())
      for t in entry["timings"])
  return (f"{device_kind}, jax {entry['jax_version']}, {entry['date']}, "
          f"`{entry['command']}`: {times}")


def _parse(text: str, device_kind: str, platform: str) -> dict[str, dict]:
  """The ops of a measured-choices file, checked; ValueError says what is wrong."""
  doc = json.loads(text)  # json.JSONDecodeError is a ValueError
  if not isinstance(doc, dict) or doc.get("format") != FORMAT:
    raise ValueError(f"not a format-{FORMAT} measured-choices file")
  if (doc.get("device_kind"), doc.get("platform")) != (device_kind, platform):
    raise ValueError(f"measured on {doc.get('device_kind')!r} ({doc.get('platform')}), "
                     f"not this {device_kind!r} ({platform})")
  ops = doc.get("ops")
  if not isinstance(ops, dict):
    raise ValueError("no 'ops' object")
  for op, entry in ops.items():
    try:
      chosen = entry["backend"]
      why_measured(device_kind, entry)
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"op {op!r}: malformed entry ({type(e).__name__}: {e})") from None
    if not isinstance(chosen, str) or not eligible(platform, chosen):
      raise ValueError(f"op {op!r}: {chosen!r} cannot run under auto on {platform}")
  return ops


@functools.cache
def _measured_here(platform: str) -> dict[str, Choice]:
  """op -> Choice from this device kind's measured-choices file ({} without a usable one)."""
  kind = jax.devices()[0].device_kind
  path = measured_path(kind)
  try:
    text = path.read_text()
  except (FileNotFoundError, NotADirectoryError):  # none measured, or no cache folder at all
    return {}
  except OSError as e:
    warnings.warn(f"kvjax: cannot read the measured auto choices {path} ({e}); using the "
                  "committed table", stacklevel=4)
    return {}
  try:
    ops = _parse(text, kind, platform)
  except ValueError as e:
    warnings.warn(f"kvjax: ignoring the measured auto choices {path}: {e}; using the "
                  "committed table", stacklevel=4)
    return {}
  return {op: Choice(e["backend"], f"{why_measured(kind, e)} ({path})")
          for op, e in ops.items()}


def forget_measured() -> None:
  """Makes the next ``auto_choice`` read the measured-choices file again (after a
  new measurement; programs already traced keep what they resolved)."""
  _measured_here.cache_clear()
