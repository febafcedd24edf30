"""summary.md and PNG plots from results.jsonl rows.

Tables: one per (task, haystack, mode, prefill chunk, length), a row per
policy entry, a column per budget; cells are accuracy (mean score where the
metric is not exact) over the samples. Full cache heads each table. A row is
labelled ``name (field=value, ...)`` with the fields set explicitly (by
--window or its --policies entry), so two entries of one policy are two rows;
a closing "Settings" table gives every setting each label ran with
(``policy_settings``). Plots: the NIAH depth × length heatmap of each policy
at each budget, and accuracy against budget per policy with the full cache as
a line (a bar per policy, the full cache's first, where the run has one
budget); their titles and legends use the same labels.

The report is rebuilt from the run's own rows only (``runner.run`` returns
those), and the plots it owns (OWNED_PLOTS) that the run does not draw are
removed: nothing in the folder describes an earlier, different run.
"""

from __future__ import annotations

import collections
import pathlib
from typing import Iterable

import numpy as np

from kvjax import plots
from kvjax.eval import policy_entries

# The PNG names the report draws (and removes when a run no longer draws them).
OWNED_PLOTS = ("heatmap_*.png", "accuracy_vs_budget_*.png")


def _group(row: dict) -> tuple:
  return (row["task"], row.get("haystack") or "-", bool(row["query_aware"]),
          int(row.get("prefill_chunk") or 0))


def _group_title(group: tuple) -> str:
  task, haystack, aware, chunk = group
  parts = [task]
  if haystack != "-":
    parts.append(f"{haystack} haystack")
  parts.append("query-aware" if aware else "query-agnostic")
  parts.append(f"prefill chunk {chunk}" if chunk else "one-shot prefill")
  return ", ".join(parts)


def _by_group(rows) -> dict[tuple, list[dict]]:
  groups = collections.defaultdict(list)
  for r in rows:
    groups[_group(r)].append(r)
  return groups


def _slug(group: tuple) -> str:
  task, haystack, aware, chunk = group
  slug = f"{task}_{haystack}_{'aware' if aware else 'agnostic'}"
  return slug + (f"_chunk{chunk}" if chunk else "")


def _value(rows: list[dict]) -> float:
  """Accuracy for exact metrics, mean score otherwise."""
  if all(r.get("metric", "contains") == "contains" for r in rows):
    return float(np.mean([bool(r["correct"]) for r in rows]))
  return float(np.mean([r["score"] for r in rows]))


def cell_text(rows: list[dict]) -> str:
  """A table cell: ``"85% (20)"``, the accuracy of ``rows`` and their count."""
  return f"{100 * _value(rows):.0f}% ({len(rows)})"


def label(row: dict) -> str:
  """The row's policy and the fields set explicitly: ``sablock (window=8)``."""
  return policy_entries.label(row["policy"], row.get("policy_fields"))


def _label_order(item) -> tuple:
  """(policy, label) pairs: the full cache first, then by label."""
  policy, text = item
  return (policy != "full", text)


def summary_markdown(rows: Iterable[dict], *, reused: int | None = None,
                     source: str | pathlib.Path | None = None) -> str:
  """The accuracy tables of a run, in markdown.

  Args:
    rows: the run's rows.
    reused: how many of them an earlier run wrote (said in the heading's line).
    source: the file they were reused from.
  """
  rows = list(rows)
  if not rows:
    return "No results.\n"
  model = rows[0]["model"]
  count = f"{len(rows)} rows"
  if reused is not None:
    count += (f", {reused} reused from an earlier run" + (f" ({source})" if source else "")
              + f", {len(rows) - reused} run now")
  lines = [f"# Accuracy ({model})", "", count + ".", "",
           "Cells: accuracy (mean score for non-exact metrics) over the samples, n in brackets. "
           "After a policy's name, in brackets: the fields set explicitly (--window, or in "
           "its --policies entry); every other field has the policy's default. Settings, at "
           "the end, lists each one's values.", ""]
  by_group = _by_group(rows)
  for group in sorted(by_group):
    group_rows = by_group[group]
    budgets = sorted({r["budget"] for r in group_rows if r["budget"] is not None})
    for length in sorted({r["length"] for r in group_rows}):
      at = [r for r in group_rows if r["length"] == length]
      lines += [f"## {_group_title(group)}, {length} tokens", ""]
      lines.append("| policy | " + " | ".join(f"{b}" for b in budgets) + " |" if budgets
                   else "| policy | full |")
      lines.append("|---|" + "---|" * max(1, len(budgets)))
      cells = collections.defaultdict(list)
      for r in at:
        cells[(r["policy"], label(r), r["budget"])].append(r)
      labels = sorted({(p, l) for p, l, _ in cells}, key=_label_order)
      for policy, name in labels:
        if policy == "full":
          full = cells[(policy, name, None)]
          text = cell_text(full)
          lines.append("| **full** | " + " | ".join([text] * max(1, len(budgets))) + " |")
          continue
        out = []
        for b in budgets:
          c = cells.get((policy, name, b))
          out.append(cell_text(c) if c else "–")
        lines.append(f"| {name} | " + " | ".join(out) + " |")
      lines.append("")
  lines += _depth_tables(by_group)
  lines += settings_table(rows)
  return "\n".join(lines)


def settings_table(rows: Iterable[dict]) -> list[str]:
  """The "Settings" section: every setting each (policy, label) ran with, one table row each.

  A label whose rows ran with different settings (rows of runs made under
  other defaults) gets a table row per set of settings; rows written before
  settings were recorded say "not recorded".
  """
  seen = collections.defaultdict(list)
  for r in rows:
    values = r.get("policy_settings")
    if values not in seen[(r["policy"], label(r))]:
      seen[(r["policy"], label(r))].append(values)
  lines = ["## Settings", "",
           "Every field of each policy as it ran: its defaults, with --window and the fields "
           "of its --policies entry (the label's brackets) over them.", "",
           "| policy | settings |", "|---|---|"]
  for key in sorted(seen, key=_label_order):
    for values in seen[key]:
      text = policy_entries.settings_text(values).replace("|", "\\|")
      lines.append(f"| {key[1]} | {text} |")
  return lines + [""]


def _depth_tables(by_group) -> list[str]:
  """Depth × length accuracy of each policy and budget (the heatmaps' numbers)."""
  lines = []
  for group in sorted(by_group):
    rows = [r for r in by_group[group] if r.get("depth") is not None]
    lengths = sorted({r["length"] for r in rows})
    if len(lengths) < 2:
      continue
    configs = sorted({(r["policy"], label(r), r["budget"] or 0) for r in rows},
                     key=lambda x: (x[0] != "full", x[1:]))
    for _, text, budget in configs:
      mine = [r for r in rows if label(r) == text and (r["budget"] or 0) == budget]
      lines += [f"## {_group_title(group)}: {text}"
                + (f" at budget {budget}" if budget else "") + ", depth × length", "",
                "| depth | " + " | ".join(str(n) for n in lengths) + " |",
                "|---|" + "---|" * len(lengths)]
      for d in sorted({r["depth"] for r in mine}):
        cells = []
        for n in lengths:
          c = [r for r in mine if r["depth"] == d and r["length"] == n]
          cells.append(cell_text(c) if c else "–")
        lines.append(f"| {d:.0%} | " + " | ".join(cells) + " |")
      lines.append("")
  return lines


def plot_heatmaps(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
  """Depth × length accuracy per policy, one PNG per (group, budget); full in each."""
  paths = []
  by_group = _by_group(r for r in rows if r.get("depth") is not None)
  for group, group_rows in sorted(by_group.items()):
    depths = sorted({r["depth"] for r in group_rows})
    lengths = sorted({r["length"] for r in group_rows})
    budgets = sorted({r["budget"] for r in group_rows if r["budget"] is not None}) or [None]
    policies = sorted({(r["policy"], label(r)) for r in group_rows}, key=_label_order)
    for budget in budgets:
      fig, axes = plots.panels(len(policies), 1.2 / len(policies) + 0.55 * len(lengths) + 1,
                               1.2 + 0.35 * len(depths) + 0.6)
      for ax, (policy, text) in zip(axes, policies):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
          for j, n in enumerate(lengths):
            cell = [r for r in group_rows if label(r) == text and r["depth"] == d
                    and r["length"] == n and (policy == "full" or r["budget"] == budget)]
            if cell:
              grid[i, j] = _value(cell)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
          for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
              ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n)
                                            for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(text, fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=7)
      axes[0].set_ylabel("needle depth", fontsize=7)
      fig.suptitle(f"{_group_title(group)}, " + (f"budget {budget}" if budget else "full cache"),
                   fontsize=9)
      paths.append(plots.save(
          fig, out / f"heatmap_{_slug(group)}_{f'b{budget}' if budget else 'full'}.png"))
  return paths


def plot_accuracy_vs_budget(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
  """Accuracy against budget per policy, one panel per length, one PNG per group.

  The full cache is a dashed line; with a single budget, a bar per policy.
  """
  paths = []
  for group, group_rows in sorted(_by_group(rows).items()):
    if not any(r["budget"] is not None for r in group_rows):
      continue
    lengths = sorted({r["length"] for r in group_rows})
    fig, axes = plots.panels(len(lengths), 4.2, 3.4, sharey=True)
    for ax, length in zip(axes, lengths):
      at = [r for r in group_rows if r["length"] == length]
      by_config = collections.defaultdict(list)
      for r in at:
        by_config[(r["policy"], label(r), r["budget"])].append(r)
      series = collections.defaultdict(list)
      for (policy, text, budget), cell in by_config.items():
        if policy != "full":
          series[text].append((budget, 100 * _value(cell)))
      full = [r for r in at if r["policy"] == "full"]
      reference = {"full": 100 * _value(full)} if full else {}
      budgets = {b for points in series.values() for b, _ in points}
      if len(budgets) == 1 and full:  # one budget: the full cache is a bar beside the others
        series["full"] = [(budgets.pop(), reference.pop("full"))]
      plots.compare(ax, series, xlabel="budget (KV entries per layer and KV head)",
                    ylabel="accuracy (%)" if ax is axes[0] else "", ylim=(-5, 105),
                    reference=reference or None, dodge=0.05, first=("full",))
      ax.set_title(f"{length} tokens", fontsize=9)
    fig.suptitle(_group_title(group), fontsize=10)
    paths.append(plots.save(fig, out / f"accuracy_vs_budget_{_slug(group)}.png"))
  return paths


def write_report(rows: list[dict], out: str | pathlib.Path, *,
                 reused: int | None = None) -> str:
  """Writes summary.md and the plots of ``rows`` under ``out``; returns the summary text.

  Plots of an earlier run (OWNED_PLOTS names) that these rows do not draw are
  removed. ``reused`` defaults to the count ``runner.run``'s rows carry.
  """
  out = pathlib.Path(out)
  if reused is None:
    reused = getattr(rows, "reused", None)
  summary = summary_markdown(rows, reused=reused, source=getattr(rows, "path", None))
  (out / "summary.md").write_text(summary)
  drawn = {p.name for plot in (plot_heatmaps, plot_accuracy_vs_budget) for p in plot(rows, out)}
  for path in _owned_plots(out):
    if path.name not in drawn:
      path.unlink()
  return summary


def remove_outputs(out: str | pathlib.Path) -> None:
  """Removes summary.md and the plots the report owns under ``out`` (an earlier run's)."""
  out = pathlib.Path(out)
  for path in [out / "summary.md", *_owned_plots(out)]:
    path.unlink(missing_ok=True)


def _owned_plots(out: pathlib.Path) -> list[pathlib.Path]:
  return sorted({p for pattern in OWNED_PLOTS for p in out.glob(pattern) if p.is_file()})
