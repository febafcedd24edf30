"""results.jsonl: the eval's rows, one JSON object a line, keyed by the work they record.

A row's key is every field that changes what was computed (KEY_FIELDS): the
model, the task, the dataset file and a hash of the sample's own content (so
two datasets without ``id`` fields never share a key), the sample's id,
length and depth, the policy with the fields set explicitly (``--window``'s
and its entry's: two entries of one policy never share a key) and every
setting it ran with (so a changed default runs the row again), the budget,
the query mode, the prefill chunk, packed weights, the seed, the generation
length and the metric. A resumed run reuses a row only under an equal key.

Rows are appended whole: one write of one complete line, flushed and synced.
A run killed mid-write can still leave a torn last line (no newline, or not
JSON); ``read_rows`` reports it and ``drop_torn_line`` rewrites the file
without it (a temporary file replaced atomically). A bad line anywhere else
is not a kill's trace but damage, and an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from typing import Sequence

KEY_FIELDS = ("model", "task", "dataset", "sample_sha256", "id", "length", "depth", "policy",
              "policy_fields", "policy_settings", "budget", "query_aware", "prefill_chunk",
              "packed", "seed", "max_new_tokens", "metric")


class ResultsError(ValueError):
  """results.jsonl holds a line that is not a row (named by file and line)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What a results file holds.

  Attributes:
    rows: the complete rows, in file order.
    torn_line: the 1-based number of a torn last line (dropped), or None.
    keep_bytes: the length of the file's complete lines (what a repair keeps).
  """

  rows: list[dict]
  torn_line: int | None = None
  keep_bytes: int = 0


def row_key(row: dict) -> tuple:
  """The fields that identify a row's work, as comparable JSON texts."""
  return tuple(json.dumps(row.get(k), sort_keys=True) for k in KEY_FIELDS)


def sample_sha256(context: str, question: str, answers: Sequence[str],
                  all_classes: Sequence[str] = ()) -> str:
  """A hash of what a sample asks and expects (its prompt, answers and class labels)."""
  text = json.dumps([context, question, list(answers), list(all_classes)], ensure_ascii=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_rows(path: str | pathlib.Path) -> Loaded:
  """The rows of ``path`` (none when it does not exist).

  Raises:
    ResultsError: a line before the last is not a JSON object.
  """
  path = pathlib.Path(path)
  if not path.exists():
    return Loaded([])
  data = path.read_bytes()
  lines = data.split(b"\n")
  # A complete file ends with a newline, so the split's last piece is empty.
  complete, tail = lines[:-1], lines[-1]
  rows, keep = [], 0
  for number, line in enumerate(complete, 1):
    row = _parse(line)
    if row is None and line.strip():
      if number == len(complete) and not tail:
        return Loaded(rows, torn_line=number, keep_bytes=keep)
      raise ResultsError(f"{path}:{number}: not a results row (a JSON object); "
                         f"the file is damaged: fix or remove that line")
    if row is not None:
      rows.append(row)
    keep += len(line) + 1
  if tail:  # the last write stopped before its newline
    return Loaded(rows, torn_line=len(complete) + 1, keep_bytes=keep)
  return Loaded(rows, keep_bytes=keep)


def _parse(line: bytes) -> dict | None:
  try:
    row = json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    return None
  return row if isinstance(row, dict) else None


def drop_torn_line(path: str | pathlib.Path, loaded: Loaded) -> None:
  """Rewrites ``path`` without its torn last line and warns once on stderr."""
  path = pathlib.Path(path)
  print(f"warning: {path}:{loaded.torn_line}: torn last line (an interrupted write) dropped; "
        f"its row runs again", file=sys.stderr)
  kept = path.read_bytes()[:loaded.keep_bytes]
  fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)
  except BaseException:
    pathlib.Path(temp).unlink(missing_ok=True)
    raise


class Appender:
  """Appends rows to a results file, each as one complete line, flushed and synced."""

  def __init__(self, path: str | pathlib.Path):
    self._file = open(path, "ab", buffering=0)  # pylint: disable=consider-using-with

  def append(self, row: dict) -> None:
    data = memoryview((json.dumps(row) + "\n").encode("utf-8"))
    while data:  # a raw write may take part of the bytes
      data = data[self._file.write(data):]
    os.fsync(self._file.fileno())

  def close(self) -> None:
    self._file.close()

  def __enter__(self) -> Appender:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
