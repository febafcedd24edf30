"""summary.md and pages.png of the serving benchmark's rows (``kvjax.bench.serving``).

The summary puts the configurations side by side, each policy's tokens/s and
peak concurrency also as a ratio to the full cache's of the same run. The
plot draws the pages each step ran with (``pages_in_step`` of the row's
timeline) over the run's time, a line per configuration, and the pool as a
dashed line. It draws on a
``matplotlib.figure.Figure`` of its own (the Agg canvas): no process-wide
matplotlib state is set.
"""

from __future__ import annotations

import math
import pathlib

# The files ``write`` makes (beside results.jsonl).
FILES = ("summary.md", "pages.png")


def _number(value, fmt: str, scale: float = 1.0) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "–"
  return format(value * scale, fmt)


def _ratio(value, reference) -> str:
  if value is None or not reference:
    return "–"
  return f"{value / reference:.2f}x"


def _header(rows: list[dict]) -> list[str]:
  r0 = rows[0]
  pool = f"{r0['num_pages']:,} pages"
  if r0.get("pool_full_requests") is not None:
    pool += f" ({r0['pool_full_requests']:g} full-cache requests of the longest kind)"
  elif r0.get("kv_memory") is not None:
    pool += f" (kv_memory {r0['kv_memory']})"
  rate = r0["rate"] if r0["rate"] == "inf" else f"{r0['rate']:g}"
  lengths = f"{r0['prompt_tokens_min']:,}"
  if r0["prompt_tokens_max"] != r0["prompt_tokens_min"]:
    lengths += f"-{r0['prompt_tokens_max']:,}"
  return [
      f"# Serving benchmark ({r0['model'] or 'model'}, {r0['device_kind']}, backend "
      f"{r0['backend']})", "",
      f"{r0['num_requests']} {r0['task']} requests of {lengths} prompt tokens (asked: "
      f"{r0['prompt_tokens']:,}), {'' if r0.get('ignore_eos') else 'up to '}"
      f"{r0['max_tokens']} new tokens each{' (stop ids ignored)' if r0.get('ignore_eos') else ''}, arriving at {rate} requests/s (Poisson, seed "
      f"{r0['seed']}); one pool of {pool} for every configuration, {r0['max_slots']} slots, "
      f"{r0['steps_per_dispatch']} decode steps per dispatch, page size {r0['page_size']}.",
      "",
      "tokens/s and requests/s over the run (first arrival to last end); TTFT from a "
      "request's arrival to the step that showed its first token; TPOT (end - first token) "
      "/ (tokens - 1); concurrency: the requests that ran in a step (peak, and mean over the "
      "run's time); peak pages: the most a step ran with; accuracy: the task's metric over "
      "the completions. x full: the ratio to the full cache's figure in this run.", ""]


def summary_markdown(rows: list[dict]) -> str:
  """The configurations side by side, with their ratios to the full cache."""
  if not rows:
    return "No results.\n"
  full = next((r for r in rows if r["policy"] == "full"), None)
  ref = lambda key: None if full is None else full[key]
  lines = _header(rows) + [
      "| configuration | completed | tokens/s | x full | requests/s | TTFT p50 s | "
      "TTFT p99 s | TPOT p50 ms | TPOT p99 ms | peak concurrency | x full | "
      "mean concurrency | peak pages | preemptions | accuracy |",
      "|---|" + "---:|" * 14]
  for r in rows:
    cells = [
        r["label"], f"{r['completed']}/{r['num_requests']}",
        _number(r["output_tokens_per_s"], ".1f"),
        _ratio(r["output_tokens_per_s"], ref("output_tokens_per_s")),
        _number(r["requests_per_s"], ".3f"), _number(r["ttft_p50_s"], ".2f"),
        _number(r["ttft_p99_s"], ".2f"), _number(r["tpot_p50_s"], ".1f", 1e3),
        _number(r["tpot_p99_s"], ".1f", 1e3), str(r["peak_concurrency"]),
        _ratio(r["peak_concurrency"], ref("peak_concurrency")),
        _number(r["mean_concurrency"], ".2f"), f"{r['peak_pages']:,}", str(r["preemptions"]),
        _number(r["accuracy"], ".0%")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot_pages(rows: list[dict], path: str | pathlib.Path) -> pathlib.Path:
  """The pages each step ran with, over the step's time, a line per configuration; the
  pool dashed."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for i, r in enumerate(rows):
    timeline = r["timeline"]
    ax.step([0.0, *timeline["t"]], [0, *timeline["pages_in_step"]], where="pre",
            color=f"C{i}", label=r["label"])
  pools = sorted({r["num_pages"] for r in rows})
  for pool in pools:
    ax.axhline(pool, color="black", linestyle="--", linewidth=1,
               label=f"pool ({pool:,} pages)")
  ax.set_ylim(0, max(pools) * 1.08)
  ax.set_xlabel("time since the first arrival (s)")
  ax.set_ylabel("pages in use")
  r0 = rows[0]
  ax.set_title(f"{r0['model'] or 'model'}: {r0['num_requests']} requests of "
               f"~{r0['prompt_tokens']:,} tokens, {r0['max_slots']} slots", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  path = pathlib.Path(path)
  fig.savefig(path, dpi=110)
  return path


def write(rows: list[dict], out: str | pathlib.Path) -> str:
  """Writes summary.md and pages.png under ``out``; returns the summary."""
  out = pathlib.Path(out)
  summary = summary_markdown(rows)
  (out / FILES[0]).write_text(summary)
  if rows:
    plot_pages(rows, out / FILES[1])
  return summary
