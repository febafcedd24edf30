r"""Several eval runs side by side: one summary and one set of plots, a row per (policy, run).

  python benchmarks/compare_runs.py --out=docs/results/niah_methods_v2 \
      --run=old=results/old_aware --run=old=results/old_agnostic \
      --run=new=results/new_aware --run=new=results/new_agnostic

Each ``--run=NAME=FOLDER`` reads ``FOLDER/results.jsonl`` (a run of
``python -m kvjax.eval``); a NAME may be given several folders. Every policy
row is labelled with its run (``sablock (run=new)``); the full cache's rows are
taken from the first run that has them, so it heads each table once. The
summary opens with one table over every length, depth and haystack per mode,
then the eval's own tables (per length) and plots of the tagged rows.
"""

import collections
import pathlib

from absl import app
from absl import flags

from kvjax.eval import report
from kvjax.eval import results

flags.DEFINE_multi_string("run", None, "NAME=FOLDER: an eval folder and the name its rows get.")
flags.DEFINE_string("out", None, "Folder for summary.md and the plots.")
flags.mark_flags_as_required(["run", "out"])
FLAGS = flags.FLAGS


def tagged_rows(runs: list[str]) -> list[dict]:
  """The runs' rows, each policy's fields gaining ``run``; full-cache rows of one run only."""
  rows, full_from = [], None
  for entry in runs:
    name, _, folder = entry.partition("=")
    if not folder:
      raise app.UsageError(f"--run={entry!r}: expected NAME=FOLDER")
    for row in results.read_rows(pathlib.Path(folder) / "results.jsonl").rows:
      if row["policy"] == "full":
        full_from = full_from or name
        if name != full_from:
          continue
      else:
        row = dict(row, policy_fields={**(row.get("policy_fields") or {}), "run": name})
      rows.append(row)
  return rows


def overall_tables(rows: list[dict]) -> list[str]:
  """Per mode, accuracy over every length, depth and haystack: a row per label, a column per budget."""
  lines = []
  for aware in sorted({bool(r["query_aware"]) for r in rows}, reverse=True):
    at = [r for r in rows if bool(r["query_aware"]) == aware]
    budgets = sorted({r["budget"] for r in at if r["budget"] is not None})
    cells = collections.defaultdict(list)
    for r in at:
      for b in budgets if r["policy"] == "full" else [r["budget"]]:
        cells[(r["policy"], report.label(r), b)].append(r)
    lines += [f"## {'query-aware' if aware else 'query-agnostic'}: every length, depth and haystack",
              "", "| policy | " + " | ".join(map(str, budgets)) + " |",
              "|---|" + "---|" * len(budgets)]
    for policy, name in sorted({k[:2] for k in cells}, key=lambda k: (k[0] != "full", k[1])):
      text = [report.cell_text(c) if (c := cells.get((policy, name, b))) else "–"
              for b in budgets]
      lines.append(f"| {name} | " + " | ".join(text) + " |")
    lines.append("")
  return lines


def main(_):
  rows = tagged_rows(FLAGS.run)
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  runs = ", ".join(dict.fromkeys(e.partition("=")[0] for e in FLAGS.run))
  text = "\n".join([f"# Runs compared: {runs}", "", *overall_tables(rows)])
  (out / "summary.md").write_text(text + "\n" + report.summary_markdown(rows))
  for path in report.plot_accuracy_vs_budget(rows, out):
    print(path)
  print(out / "summary.md")


if __name__ == "__main__":
  app.run(main)
