"""The kernel section's choices for "auto": written, installed, printed for AUTO_CHOICES."""

from __future__ import annotations

import sys
import textwrap

from kvjax import backend_choices


def save_choices(rec, kind, platform, entries, choices, install) -> None:
  """Writes the choices measured so far to ``choices`` and, with ``install``, for "auto"."""
  try:
    if choices is not None:
      backend_choices.write_measured(choices, kind, platform, entries, merge=False)
    if install:
      backend_choices.write_measured(backend_choices.measured_path(kind), kind, platform,
                                     entries)
      backend_choices.forget_measured()
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


def report_choices(rec, kind, platform, entries, choices, install) -> None:
  """Prints (and notes for summary.md) where the choices went and the lines to commit."""
  if not entries:
    rec.notes.append("No auto choices: no implementation ran at every shape of an op.")
    return
  where = [f"written to {choices}"] if choices is not None else []
  if install:
    where.append(f"installed for {kind} in {backend_choices.measured_path(kind)} "
                 "(\"auto\" reads it on this device kind)")
  else:
    # A CPU's committed choices rest on float32 native kernels, which this
    # bfloat16 run does not time; a small scale's shapes are toys.
    where.append("not installed for \"auto\" (only a full-scale run on a GPU or TPU is)")
  picks = ", ".join(f"{op}: {e['backend']}" for op, e in entries.items())
  lines = [f"Auto choices measured on {kind} ({picks}): " + "; ".join(where) + ".",
           "To commit them, put these entries in `AUTO_CHOICES` "
           "(kvjax/backend_choices.py):", "", "```python",
           *table_lines(kind, platform, entries), "```"]
  rec.notes += lines
  print("\n".join(lines), flush=True)
