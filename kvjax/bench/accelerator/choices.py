"""The kernel section's choices for "auto": written to the run's folder, printed with how
to name them and the ``AUTO_CHOICES`` entries that commit them."""

from __future__ import annotations

import pathlib
import sys
import textwrap

from kvjax import backend_choices


def save_choices(rec, kind, platform, entries, choices) -> None:
  """Writes the choices measured so far to ``choices`` (the run's auto_choices.json).

  Nothing else: "auto" reads the file only where a caller names it
  (``kvjax.backend_choices``), so a run changes no later call by itself.
  """
  try:
    backend_choices.write_measured(choices, kind, platform, entries)
  except OSError as e:
    rec.notes.append(f"Writing the auto choices failed: {type(e).__name__}: {e}")
    print(f"kvjax: writing the auto choices failed: {e}", file=sys.stderr, flush=True)


def table_lines(kind: str, platform: str, entries: dict[str, dict]) -> list[str]:
  """``AUTO_CHOICES`` entries (Python source) for the measured ops."""
  lines = []
  for op, entry in entries.items():
    why = backend_choices.why_measured(kind, entry)
    pieces = textwrap.wrap(why, 76, drop_whitespace=False, break_long_words=False)
    lines += [f"    ({platform!r}, {op!r}): Choice(", f"        {entry['backend']!r},"]
    lines += [f"        {piece!r}" for piece in pieces[:-1]]
    lines.append(f"        {pieces[-1]!r}),")
  return lines


def usage_lines(choices) -> list[str]:
  """How to make "auto" take the choices in the file ``choices``."""
  env = backend_choices.CHOICES_ENV
  choices = pathlib.Path(choices).absolute()  # to name it from any folder
  return ["\"auto\" takes them only where the file is named: for a process,",
          "", "```sh", f"export {env}={choices}", "```", "",
          f"or for one execution, `kvjax.execution.create(\"auto\", choices=\"{choices}\")`. "
          "Without either, \"auto\" runs the committed table."]


def report_choices(rec, scale, kind, platform, entries, choices) -> None:
  """Prints (and notes for summary.md) the choices, how to use them and the lines to commit."""
  if not entries:
    rec.notes.append("No auto choices: no implementation ran at every shape of an op.")
    return
  picks = ", ".join(f"{op}: {e['backend']}" for op, e in entries.items())
  where = f"written to {choices}" if choices is not None else "not written"
  lines = [f"Auto choices measured on {kind} ({picks}): {where}."]
  if choices is not None:
    lines += usage_lines(choices)
  lines += ["", "To commit them, put these entries in `AUTO_CHOICES` "
            "(kvjax/backend_choices.py):", "", "```python",
            *table_lines(kind, platform, entries), "```"]
  if scale.name == "small" or platform == "cpu":
    # A CPU's committed choices rest on float32 native kernels, which this
    # bfloat16 run does not time; a small scale's shapes are toys.
    lines.append("(Measured at toy sizes or on a CPU: entries to check the plumbing with, "
                 "not to commit.)")
  rec.notes += lines
  print("\n".join(lines), flush=True)
