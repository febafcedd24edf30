"""PNG plots shared by the benchmark and evaluation reports.

matplotlib loads on the first plot (with the file-only Agg backend), so
importing a report costs nothing where no plot is drawn. A plot draws only
what carries information: one x value shared by every series becomes bars
(lines of one point would sit on top of each other), and a value axis is
linear from 0 unless the values span more than 10x.
"""

from __future__ import annotations

import pathlib
from typing import Callable, Iterable, Mapping, Sequence

# A value axis turns logarithmic only when its values span more than this factor.
LOG_SPAN = 10.0
# Values closer than this fraction of the largest are equal within a measurement's noise.
NOISE_SPREAD = 0.01


def write_report(out: str | pathlib.Path, summary: str, rows: list[dict],
                 plotters: Iterable[Callable[[list[dict], pathlib.Path], list]]) -> str:
  """Writes ``summary`` to summary.md and each plotter's PNGs under ``out``; returns it."""
  out = pathlib.Path(out)
  (out / "summary.md").write_text(summary)
  for plot in plotters:
    plot(rows, out)
  return summary


def pyplot():
  """matplotlib.pyplot on the Agg backend (files only; no display on servers)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def panels(count: int, width: float, height: float, **kwargs):
  """(figure, row of ``count`` axes), each panel ``width`` x ``height`` inches."""
  fig, axes = pyplot().subplots(1, count, squeeze=False, figsize=(width * count, height),
                                **kwargs)
  return fig, list(axes[0])


def save(fig, path: pathlib.Path) -> pathlib.Path:
  """Writes the figure to ``path`` (PNG) and frees it."""
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot().close(fig)
  return path


def value_scale(ax, values: Sequence[float], *, axis: str = "y") -> None:
  """Linear from 0, or log where the positive ``values`` span more than LOG_SPAN.

  A log axis over a narrow range (982.69-982.73 MiB) makes noise look like a
  gap; from 0, equal values look equal.
  """
  values = [v for v in values if v is not None]
  if values and min(values) > 0 and max(values) / min(values) > LOG_SPAN:
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
  elif values and min(values) >= 0:
    (ax.set_ylim if axis == "y" else ax.set_xlim)(0, max(values) * 1.08 or 1.0)


def note_if_equal(ax, values: Sequence[float], *, spread: float = NOISE_SPREAD,
                  unit: str = "") -> bool:
  """Writes on ``ax`` that its values are equal within noise, where they spread less than
  ``spread`` (a fraction of the largest); returns whether it did.

  Bars of 982.69 and 982.73 MiB look equal from 0, as they are; the note says
  so in words instead of leaving a reader to look for a difference.
  """
  values = [v for v in values if v is not None]
  if len(values) < 2 or max(values) <= 0 or (max(values) - min(values)) > spread * max(values):
    return False
  ax.text(0.5, 0.5, f"all equal within {spread:.0%}: {min(values):.4g}-{max(values):.4g}"
          f"{' ' + unit if unit else ''}", transform=ax.transAxes, ha="center", va="center",
          fontsize=8, bbox=dict(facecolor="white", alpha=0.85, edgecolor="gray"))
  return True


def compare(ax, series: Mapping[str, Sequence[tuple[float, float]]], *, xlabel: str,
            ylabel: str, ylim: tuple[float, float] | None = None,
            reference: Mapping[str, float] | None = None, dodge: float = 0.0,
            first: Sequence[str] = ()) -> None:
  """y against x for each label: lines, or bars when every series has the same single x.

  Args:
    series: {label: [(x, y), ...]}; x > 0 (a log2 axis when lines are drawn).
    ylim: fixed value limits (accuracy: 0-100%); default ``value_scale``.
    reference: {label: y} dashed horizontal lines (the full cache).
    dodge: shifts each line's markers sideways by this many octaves per label,
      so series with equal values (accuracies often are) stay visible side by side.
    first: labels drawn before the others (sorted), in this order.
  """
  labels = [l for l in first if l in series] + sorted(set(series) - set(first))
  xs = sorted({x for points in series.values() for x, _ in points})
  values = [y for points in series.values() for _, y in points] + list((reference or {}).values())
  if len(xs) == 1:
    ax.bar(range(len(labels)), [series[label][0][1] for label in labels],
           color=[f"C{i}" for i in range(len(labels))])
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_xlabel(f"{xlabel}: {xs[0]:g}")
  else:
    for i, label in enumerate(labels):
      points = sorted(series[label])
      shift = 2.0 ** ((i - (len(labels) - 1) / 2) * dodge)
      ax.plot([x * shift for x, _ in points], [y for _, y in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel(xlabel)
  for i, (label, y) in enumerate(sorted((reference or {}).items())):
    ax.axhline(y, color="black", linestyle=("--", ":", "-.")[i % 3], label=label)
  if ylim is not None:
    ax.set_ylim(*ylim)
  else:
    value_scale(ax, values)
  ax.set_ylabel(ylabel)
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7, loc="best")
