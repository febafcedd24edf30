"""summary.md: the run's header, a table per section, and what "auto" runs."""

from __future__ import annotations

import jax

from kvjax.bench.accelerator.recorder import fmt
from kvjax.bench.accelerator.scales import Scale
from kvjax.bench.accelerator.scales import command
from kvjax.bench.accelerator.scales import model_config
from kvjax.bench.accelerator.specs import DeviceSpec

SECTIONS = ("kernel", "decode", "throughput", "prefill", "equality")
TITLES = {
    "kernel": "Paged decode attention (one query token per sequence)",
    "decode": "Decode step, batch 1 (synthetic cache)",
    "throughput": "Decode throughput by batch (synthetic cache)",
    "prefill": "Prefill of a random prompt",
    "equality": "Greedy tokens, backend pallas vs xla",
}


def _cell(row: dict, key: str, unit: str = "") -> str:
  if row["status"] != "ok":
    return "—"
  return fmt(row.get(key)) + (f" {unit}" if unit and row.get(key) is not None else "")


def _equality_table(rows: list[dict]) -> list[str]:
  lines = ["| policy | implementations | greedy tokens equal | tokens | note |",
           "|---|---|---|---|---|"]
  for r in rows:
    ok = r["status"] == "ok"
    note = (r["error"][:160] if not ok else "" if r["equal"]
            else f"first differs at token {r['first_diff']}")
    lines.append(f"| {r['label']} | {r['impl']} | "
                 f"{fmt(r['equal']) if ok else r['status']} | "
                 f"{r.get('tokens', '—') if ok else '—'} | {note} |")
  return lines


def _timing_table(section: str, rows: list[dict]) -> list[str]:
  lines = ["| measurement | implementation | now | floor | of floor | note |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    note = (f"{r['status'].upper()}: {r['error'][:160]}" if r["status"] != "ok"
            else f"{r['floor_bound']}-bound" if r.get("floor_bound") else "")
    if section == "kernel" and r["status"] == "ok":
      note = ", ".join(filter(None, [f"{fmt(1e3 * r['seconds'])} ms", note]))
    lines.append(f"| {r['label']} | {r['impl']} | {_cell(r, 'value', r.get('unit', ''))} | "
                 f"{_cell(r, 'floor', r.get('unit', ''))} | {_cell(r, 'of_floor')} | "
                 f"{note} |")
  return lines


def summary_markdown(rows: list[dict], header: list[str], sections=SECTIONS,
                     notes: list[str] = ()) -> str:
  """A table per section (rows in measuring order, a label's rows together) under
  ``header``'s lines, then ``notes``."""
  lines = list(header)
  for section in SECTIONS:
    lines += ["", f"## {TITLES[section]}", ""]
    these = [r for r in rows if r["section"] == section]
    first = {}
    for i, r in enumerate(these):
      first.setdefault(r["label"], i)
    these.sort(key=lambda r: first[r["label"]])  # a shape's rows together (auto comes last)
    if not these:
      lines.append("not run" if section not in sections else "no rows (see the log)")
    elif section == "equality":
      lines += _equality_table(these)
    else:
      lines += _timing_table(section, these)
  if notes:
    lines += ["", "## What auto runs", "", *notes]
  return "\n".join(lines) + "\n"


def header(kind: str, spec: DeviceSpec | None, scale: Scale, scan_layers: bool,
           seconds: float) -> list[str]:
  """summary.md's first lines: the chip, the command, the model, the floor's figures."""
  c, eq = model_config(scale.model), model_config(scale.equality_model)
  floor = ("n/a: this chip is not in `kvjax.bench.accelerator.SPECS`" if spec is None else
           f"{spec.name}: {spec.hbm_bytes_per_s / 1e12:g} TB/s HBM, "
           f"{spec.bf16_flops_per_s / 1e12:g} TFLOP/s dense bf16 ({spec.source})")
  return [
      f"# kvjax against the physical floor: {kind} ({jax.default_backend()})", "",
      f"`{command(scale)}`, jax {jax.__version__}, {seconds:.0f} s in all.",
      f"Model: random {c.name} shape ({c.num_layers} layers, N={c.num_heads} "
      f"K={c.num_kv_heads} H={c.head_dim}, D={c.hidden_size}), {scale.dtype}, layers "
      f"{'scanned' if scan_layers else 'unrolled'}; page size {scale.page_size}; "
      f"{scale.decode_steps} decode steps, best of {scale.repeats} after a warm-up.",
      f"Floor: max(bytes moved / HBM bandwidth, FLOPs / peak); {floor}. "
      "`of floor`: floor time / measured time (1 = at the floor). Decode bytes: the "
      "weights plus the kept keys and values, per step.",
      f"Equality: random {eq.name} shape, float32, a {scale.equality_prompt}-token prompt "
      f"of random ids, {scale.equality_tokens} greedy tokens, budget "
      f"{scale.equality_budget}.",
  ] + (["", "**Small scale**: toy shapes, Pallas in its interpreter: a check that "
        "every section runs, not a measurement of speed."] if scale.name == "small" else [])
