"""summary.md and PNG plots of benchmark rows.

A policy is labelled ``name (field=value, ...) @ budget`` with the fields set
explicitly (--window, or in its --policies entry), in the tables and the plots'
legends alike; the summary ends with every setting each label ran with.
"""

from __future__ import annotations

import collections
import pathlib

from kvjax import plots
from kvjax.eval import policy_entries

MIB = 2**20
# The PNG files ``plot`` writes.
PLOTS = ("decode_ms_per_token.png", "peak_memory.png")


def _policy_label(row: dict) -> str:
  return policy_entries.label(row["policy"], row.get("policy_fields"))


def _label(row: dict) -> str:
  label = _policy_label(row)
  label += "" if row["budget"] is None else f" @ {row['budget']}"
  return label + (f", chunk {row['prefill_chunk']}" if row.get("prefill_chunk") else "")


def _settings_lines(rows: list[dict]) -> list[str]:
  """Every setting each policy label ran with, a table row per distinct set."""
  seen = collections.defaultdict(list)
  for r in rows:
    values = r.get("policy_settings")
    if values not in seen[_policy_label(r)]:
      seen[_policy_label(r)].append(values)
  lines = ["", "## Settings", "",
           "Every field of each policy as it ran: its defaults, with --window and the fields "
           "of its --policies entry (the label's brackets) over them.", "",
           "| policy | settings |", "|---|---|"]
  for label in sorted(seen, key=lambda l: (not l.startswith("full"), l)):
    for values in seen[label]:
      text = policy_entries.settings_text(values).replace("|", "\\|")
      lines.append(f"| {label} | {text} |")
  return lines


def summary_markdown(rows: list[dict]) -> str:
  """Tables of decode ms/token, speed-up over the full cache, prefill and memory."""
  if not rows:
    return "No results.\n"
  lengths = sorted({r["context_length"] for r in rows})
  by = {(_label(r), r["context_length"]): r for r in rows}
  labels = sorted({_label(r) for r in rows}, key=lambda l: (not l.startswith("full"), l))
  head = "| policy | " + " | ".join(f"{n:,}" for n in lengths) + " |"
  rule = "|---|" + "---|" * len(lengths)
  r0 = rows[0]
  lines = [f"# Benchmark ({r0['model']}, batch {r0['batch_size']}, {r0['device']}, "
           f"backend {r0['backend']}, layers "
           f"{'scanned' if r0.get('scan_layers', True) else 'unrolled'}"
           f"{', packed weights' if r0.get('packed') else ''})", "",
           "Columns: context length in tokens. `*` marks a cache filled with synthetic keys "
           "and values (no prefill). Decode times are the best of the repeats after a "
           "warm-up."]
  if any(r.get("compilation_cache") for r in rows):
    compiled = sum(r["programs_compiled"] for r in rows)
    loaded = sum(r["programs_from_cache"] for r in rows)
    lines += ["", f"Programs: {loaded} loaded from the compilation cache, {compiled} compiled "
              "by the measuring processes (a row's peaks leave out the compiler's memory "
              "where its programs_compiled is 0)."]
  lines += ["", "## Decode ms per token", "", head, rule]

  def cells(fmt):
    for label in labels:
      out = []
      for n in lengths:
        r = by.get((label, n))
        out.append("–" if r is None else fmt(r, by.get(("full", n))))
      lines.append(f"| {label} | " + " | ".join(out) + " |")

  star = lambda r: "*" if r["fill"] == "synthetic" else ""
  cells(lambda r, f: f"{r['decode_ms_per_token']:.1f}{star(r)}")
  lines += ["", "## Decode speed-up over the full cache (same run)", "", head, rule]
  cells(lambda r, f: "–" if f is None else
        f"{f['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x")
  if any(r["prefill_s"] is not None for r in rows):
    lines += ["", "## Prefill + compression seconds", "", head, rule]
    cells(lambda r, f: "–" if r["prefill_s"] is None else f"{r['prefill_s']:.2f}")
  lines += ["", "## KV cache allocated, MiB", "", head, rule]
  cells(lambda r, f: f"{r['kv_bytes'] / MIB:.1f}")
  lines += ["", "## Peak process memory (ru_maxrss), MiB", "", head, rule]
  cells(lambda r, f: f"{r['peak_rss_bytes'] / MIB:.0f}")
  if any(r.get("estimated_bytes") for r in rows):
    lines += ["", "## Estimated before running (weights + cache + activations), MiB", "",
              head, rule]
    cells(lambda r, f: "–" if not r.get("estimated_bytes") else
          f"{r['estimated_bytes'] / MIB:.0f}")
  if any(r.get("buffer_peak_bytes") for r in rows):
    lines += ["", "## Peak of live jax buffers (arrays + a program's scratch), MiB", "",
              head, rule]
    cells(lambda r, f: "–" if not r.get("buffer_peak_bytes") else
          f"{r['buffer_peak_bytes'] / MIB:.0f}")
  if any(r.get("device_peak_bytes") for r in rows):
    lines += ["", "## Peak device memory (memory_stats), MiB", "", head, rule]
    cells(lambda r, f: "–" if not r.get("device_peak_bytes") else
          f"{r['device_peak_bytes'] / MIB:.0f}")
  lines += _settings_lines(rows)
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
  """Plots against context length, a line per policy: decode ms/token, and peak memory.

  peak_memory.png has a panel per measure of memory: the process's peak
  resident set and, where the rows have it, the peak of live jax buffers.
  With one context length, each plot is a bar per policy. Value axes are
  linear from 0 (``plots.value_scale``); a panel whose values are equal within
  1% says so on the plot (``plots.note_if_equal``).
  """
  series = collections.defaultdict(list)
  for r in rows:
    series[_label(r)].append(r)
  memory = [(lambda r: r["peak_rss_bytes"] / MIB, "peak process memory (MiB)", "MiB")]
  if all(r.get("buffer_peak_bytes") for r in rows):
    memory.append((lambda r: r["buffer_peak_bytes"] / MIB, "peak of live jax buffers (MiB)",
                   "MiB"))
  r0 = rows[0]
  paths = []
  for name, measures in (
      (PLOTS[0], [(lambda r: r["decode_ms_per_token"], "decode ms / token", "ms")]),
      (PLOTS[1], memory)):
    fig, axes = plots.panels(len(measures), 6, 4)
    for ax, (key, ylabel, unit) in zip(axes, measures):
      plots.compare(ax, {label: [(r["context_length"], key(r)) for r in rs]
                         for label, rs in series.items()},
                    xlabel="context length (tokens)", ylabel=ylabel)
      plots.note_if_equal(ax, [key(r) for r in rows], unit=unit)
      ax.set_title(f"{r0['model']}, batch {r0['batch_size']}, {r0['device']}", fontsize=9)
    paths.append(plots.save(fig, out / name))
  return paths


def write_report(rows: list[dict], out: str | pathlib.Path) -> str:
  """Writes summary.md and the plots under ``out``; returns the summary text."""
  return plots.write_report(out, summary_markdown(rows), rows, [plot])
