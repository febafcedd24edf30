r"""NIAH accuracy of policies compared at equal KV bytes: tables, a plot, and the bytes check.

  python benchmarks/equal_bytes_table.py --out=docs/results/head_budgets \
      --rows=heads_aware --rows=heads_agnostic --rows=duo_aware ... \
      --shift=streaming_llm=16

Reads each ``--rows`` folder's results.jsonl (runs of ``python -m kvjax.eval``)
and writes summary.md and accuracy_equal_bytes.png to ``--out``. A budget is
the one whose KV bytes a row holds: ``--shift=POLICY=N`` files that policy's
rows at budget b + N under b (StreamingLLM evicts while decoding, so its cache
has no slots for the N new tokens: at b + N it holds what the others hold at
b). The bytes table checks it: per budget, mode and prompt length, the KV
bytes of every compared row, and whether they are all equal.
"""

import collections
import pathlib

from absl import app
from absl import flags

from kvjax import plots
from kvjax.eval import report
from kvjax.eval import results

flags.DEFINE_multi_string("rows", None, "An eval folder holding results.jsonl.")
flags.DEFINE_multi_string("shift", [], "POLICY=N: that policy's budget b + N counts as b.")
flags.DEFINE_string("out", None, "Folder for summary.md and the plot.")
flags.mark_flags_as_required(["rows", "out"])
FLAGS = flags.FLAGS

MODES = ((True, "query-aware"), (False, "query-agnostic"))


def load(folders: list[str], shifts: dict[str, int]) -> list[dict]:
  """Every row, its budget shifted back to the budget whose bytes it holds."""
  rows = []
  for folder in folders:
    for row in results.read_rows(pathlib.Path(folder) / "results.jsonl").rows:
      if row["budget"] is not None:
        row = dict(row, budget=row["budget"] - shifts.get(row["policy"], 0))
      rows.append(row)
  return rows


def accuracy_table(rows: list[dict], aware: bool) -> tuple[list[str], dict]:
  """Markdown lines and {label: [(budget, accuracy %)]} for one mode."""
  at = [r for r in rows if bool(r["query_aware"]) == aware]
  budgets = sorted({r["budget"] for r in at if r["budget"] is not None})
  cells = collections.defaultdict(list)
  for r in at:
    for b in budgets if r["policy"] == "full" else [r["budget"]]:
      cells[(report.label(r), b)].append(r["score"])
  labels = sorted({label for label, _ in cells}, key=lambda l: (l != "full", l))
  lines = ["| policy | " + " | ".join(map(str, budgets)) + " |",
           "|---|" + "---|" * len(budgets)]
  series = {}
  for label in labels:
    row = []
    for b in budgets:
      scores = cells.get((label, b), [])
      row.append(f"{100 * sum(scores) / len(scores):.0f}% ({len(scores)})" if scores else "–")
      if scores and label != "full":
        series.setdefault(label, []).append((b, 100 * sum(scores) / len(scores)))
    lines.append(f"| {label} | " + " | ".join(row) + " |")
  return lines, series


def bytes_table(rows: list[dict]) -> list[str]:
  """Per (mode, length, budget): each label's KV MiB, and whether they are all equal."""
  kv = collections.defaultdict(set)
  for r in rows:
    if r["budget"] is not None:
      kv[(bool(r["query_aware"]), r["length"], r["budget"])].add((report.label(r), r["kv_bytes"]))
  lines = ["| mode | length | budget | KV MiB per policy | equal |", "|---|---|---|---|---|"]
  for (aware, length, budget), pairs in sorted(kv.items(), key=lambda kv_: (not kv_[0][0],) + kv_[0][1:]):
    by_label = collections.defaultdict(set)
    for label, value in pairs:
      by_label[label].add(value)
    text = ", ".join(f"{label} {'/'.join(f'{v / 2**20:.2f}' for v in sorted(values))}"
                     for label, values in sorted(by_label.items()))
    equal = "yes" if len({v for _, v in pairs}) == 1 else "**no**"
    lines.append(f"| {'aware' if aware else 'agnostic'} | {length} | {budget} | {text} | {equal} |")
  return lines


def main(argv):
  del argv
  shifts = {}
  for entry in FLAGS.shift:
    name, _, n = entry.partition("=")
    shifts[name] = int(n)
  rows = load(FLAGS.rows, shifts)
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  lines = ["# NIAH accuracy at equal KV bytes", "",
           "Accuracy (n) over every length, depth and haystack; budget = KV entries per "
           "(layer, KV head) whose bytes every row of the column holds."
           + "".join(f" {p} ran at budget + {n}." for p, n in shifts.items()), ""]
  fig, axes = plots.panels(2, 6.0, 4.0)
  for ax, (aware, title) in zip(axes, MODES):
    table, series = accuracy_table(rows, aware)
    lines += [f"## {title}", ""] + table + [""]
    full = [r["score"] for r in rows if r["policy"] == "full" and bool(r["query_aware"]) == aware]
    plots.compare(ax, series, xlabel="budget (KV entries per head)", ylabel="accuracy (%)",
                  ylim=(0, 100), dodge=0.03,
                  reference={"full": 100 * sum(full) / len(full)} if full else None)
    ax.set_title(title)
  plots.save(fig, out / "accuracy_equal_bytes.png")
  lines += ["## KV bytes of the compared rows", ""] + bytes_table(rows)
  (out / "summary.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
