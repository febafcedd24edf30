"""What ``"auto"`` runs, per platform and op, and the measurement each choice rests on.

``"auto"`` must never run a slower implementation than the one it passes
over, so it picks only what a measurement on that platform showed faster; a
pair without one runs XLA (the references, compiled by XLA for every
platform). ``auto_choice`` looks, in order, at:

  1. a measured-choices file, only where one is named: the ``choices``
     argument (``kvjax.execution.create(..., choices=path)``), else
     ``$KVJAX_AUTO_CHOICES`` (``CHOICES_ENV``). ``python -m kvjax.bench
     --preset=accelerator`` writes one, ``auto_choices.json`` in its output
     folder. It decides only for the platform it was measured on (a program
     built for another one, ``kvjax.kernels.platform.targeting``, gets the
     table); the first call it decides logs the file on the ``"kvjax"``
     logger, once per file. A named file that cannot be read, or is not a
     measured-choices file, raises: naming it asked for it;
  2. ``AUTO_CHOICES`` below, the committed measurements (the preset prints an
     entry to paste here for each op it measured);
  3. XLA (``NOT_MEASURED``).

Nothing else is consulted (no file in the cache folder): without a named
file, two machines of one kind run the same kernels for the same call.

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
import logging
import math
import os
import pathlib

import jax

CHOICES_ENV = "KVJAX_AUTO_CHOICES"

_LOG = logging.getLogger("kvjax")


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


def auto_choice(platform: str, op: str, choices=None) -> Choice:
  """What ``"auto"`` runs for ``op`` on ``platform``: the named measured-choices file's
  choice (``choices``, else ``$KVJAX_AUTO_CHOICES``), else the table's, else XLA.

  Raises:
    OSError: the named file cannot be read.
    ValueError: the named file is not a measured-choices file (says what is wrong).
  """
  path = named_file(choices)
  if path is not None:
    measured = _read(path)
    if measured.platform == platform and op in measured.ops:
      _log_once(measured)
      return measured.ops[op]
  return AUTO_CHOICES.get((platform, op), NOT_MEASURED)


def named_file(choices=None) -> pathlib.Path | None:
  """The measured-choices file that ``choices`` or else ``$KVJAX_AUTO_CHOICES`` names
  (None where neither names one)."""
  named = choices if choices is not None else os.environ.get(CHOICES_ENV)
  # An empty variable names no file: `KVJAX_AUTO_CHOICES= cmd` turns it off.
  return pathlib.Path(named).expanduser().resolve() if named else None


# ------------------------------------------------------------------ measured choices

FORMAT = 1  # the measured-choices file's layout (``write_measured``)


@dataclasses.dataclass(frozen=True)
class Measured:
  """A measured-choices file, read: where it is, what it was measured on, its choices."""

  path: pathlib.Path
  device_kind: str
  platform: str
  ops: dict[str, Choice]


def eligible(platform: str, implementation: str) -> bool:
  """Whether ``"auto"`` may run ``implementation`` on ``platform`` at all: never the
  Pallas interpreter (a CPU's Pallas), and the native kernels only on a CPU."""
  if implementation == "pallas":
    return platform != "cpu"
  return implementation != "native" or platform == "cpu"


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
                   entries: dict[str, dict]) -> pathlib.Path:
  """Writes op -> ``measured_entry`` for a device kind as JSON; returns the path.

  The file is replaced whole (written beside it, then renamed), so a reader
  never sees half of it.
  """
  path = pathlib.Path(path)
  doc = {"format": FORMAT, "device_kind": device_kind, "platform": platform,
         "ops": dict(sorted(entries.items()))}
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


def _parse(text: str) -> tuple[str, str, dict[str, dict]]:
  """(device kind, platform, ops) of a measured-choices file, checked; ValueError says
  what is wrong."""
  doc = json.loads(text)  # json.JSONDecodeError is a ValueError
  if not isinstance(doc, dict) or doc.get("format") != FORMAT:
    raise ValueError(f"not a format-{FORMAT} measured-choices file")
  kind, platform, ops = doc.get("device_kind"), doc.get("platform"), doc.get("ops")
  if not (isinstance(kind, str) and isinstance(platform, str)):
    raise ValueError("no 'device_kind' and 'platform' strings")
  if not isinstance(ops, dict):
    raise ValueError("no 'ops' object")
  for op, entry in ops.items():
    try:
      chosen = entry["backend"]
      why_measured(kind, entry)
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"op {op!r}: malformed entry ({type(e).__name__}: {e})") from None
    if not isinstance(chosen, str) or not eligible(platform, chosen):
      raise ValueError(f"op {op!r}: {chosen!r} cannot run under auto on {platform}")
  return kind, platform, ops


@functools.cache
def _read(path: pathlib.Path) -> Measured:
  """The measured-choices file at ``path``, read once per process (``forget_measured``)."""
  named = f"the measured auto choices {path} (named by choices= or ${CHOICES_ENV})"
  try:
    text = path.read_text()
  except OSError as e:
    raise type(e)(f"kvjax: cannot read {named}: {e.strerror or e}") from e
  try:
    kind, platform, ops = _parse(text)
  except ValueError as e:
    raise ValueError(f"kvjax: {named} is unusable: {e}") from None
  return Measured(path, kind, platform,
                  {op: Choice(e["backend"], f"{why_measured(kind, e)} ({path})")
                   for op, e in ops.items()})


_LOGGED: set[pathlib.Path] = set()  # files whose first decision was logged


def _log_once(measured: Measured) -> None:
  """Logs, on a file's first decision, which file decides and what it picks."""
  if measured.path in _LOGGED:
    return
  _LOGGED.add(measured.path)
  picks = ", ".join(f"{op}: {c.backend}" for op, c in measured.ops.items())
  _LOG.info('"auto" on %s takes the measured choices in %s (measured on %s): %s; other '
            "ops follow the committed table", measured.platform, measured.path,
            measured.device_kind, picks)


def forget_measured() -> None:
  """Makes the next ``auto_choice`` read (and log) measured-choices files again (after a
  new measurement; programs already traced keep what they resolved)."""
  _read.cache_clear()
  _LOGGED.clear()
