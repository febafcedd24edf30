"""Local long-context datasets in kvpress's benchmark schema (JSONL or parquet).

Each row has ``context``, ``question`` and ``answer`` (a string or a list of
acceptable strings); optional ``answer_prefix`` (appended after the
assistant's turn starts), ``max_new_tokens``, ``id``, ``metric`` (overrides
the evaluation's metric for that row) and ``all_classes`` (the candidate
labels of classification tasks). kvpress exports its benchmarks (RULER,
LongBench, InfiniteBench, ...) in this schema. Other fields are ignored.

Every row is checked against ``SCHEMA`` as it is read: a value of the wrong
type is a ``DatasetError`` naming the file, the line (JSONL) or row (parquet)
and the field, never text made of it (a null context is not "None").
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib
from collections.abc import Callable, Collection
from typing import Any

from kvjax.tasks.sample import Sample
from kvjax.tasks.sample import chat_sample

REQUIRED = ("context", "question", "answer")


class DatasetError(ValueError):
  """The file cannot be read or a row does not follow the schema."""


def _is_text(value: Any) -> bool:
  """A string that is valid Unicode text (JSON's escapes can make lone surrogates)."""
  if not isinstance(value, str):
    return False
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _is_positive_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _is_text_list(value: Any, nonempty: bool) -> bool:
  return isinstance(value, list) and (bool(value) or not nonempty) and all(map(_is_text, value))


@dataclasses.dataclass(frozen=True)
class Rule:
  """What one field of a row must be."""

  expects: str  # for messages: "<field> must be <expects>"
  accepts: Callable[[Any], bool]


# The schema of a row. Optional fields may also be absent or null (parquet
# writes null where a row lacks a column); required ones may not.
SCHEMA: dict[str, Rule] = {
    "context": Rule("a non-empty string", lambda v: _is_text(v) and bool(v.strip())),
    # Empty is allowed: the question's part of the prompt still holds the turn's end.
    "question": Rule("a string", _is_text),
    "answer": Rule("a string or a non-empty list of strings",
                   lambda v: _is_text(v) or _is_text_list(v, nonempty=True)),
    "answer_prefix": Rule("a string", _is_text),
    "max_new_tokens": Rule("a positive int", _is_positive_int),
    "id": Rule("a string or an int", lambda v: _is_text(v) or (
        isinstance(v, numbers.Integral) and not isinstance(v, bool))),
    "metric": Rule("a metric's name", lambda v: _is_text(v) and bool(v)),
    "all_classes": Rule("a list of strings", lambda v: _is_text_list(v, nonempty=False)),
}


def _shown(value: Any) -> str:
  """A value's type and a short repr, for messages."""
  text = repr(value)
  text = text if len(text) <= 60 else text[:57] + "..."
  return f"{type(value).__name__} {text}"


def check_row(row: Any, where: str, metrics: Collection[str] | None = None) -> dict:
  """``row`` if it follows SCHEMA, else a DatasetError starting with ``where``.

  Args:
    row: one parsed row.
    where: the row's place for messages ("data.jsonl: line 3").
    metrics: the metric names a row's ``metric`` may take (None: any name).
  """
  if not isinstance(row, dict):
    raise DatasetError(f"{where}: not an object (got {_shown(row)})")
  missing = [k for k in REQUIRED if k not in row]
  if missing:
    raise DatasetError(f"{where}: lacks {missing} (needs {list(REQUIRED)})")
  for field, rule in SCHEMA.items():
    value = row.get(field)
    if value is None and field not in REQUIRED:
      continue
    if not rule.accepts(value):
      raise DatasetError(f"{where}: field {field!r} must be {rule.expects}, got {_shown(value)}")
  metric = row.get("metric")
  if metric is not None and metrics is not None and metric not in metrics:
    raise DatasetError(f"{where}: field 'metric' must be one of {', '.join(metrics)}, "
                       f"got {metric!r}")
  return row


def _jsonl_rows(path: pathlib.Path) -> list[tuple[str, Any]]:
  """(where, parsed value) of each non-blank line."""
  rows = []
  with path.open("rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path}: line {number}"
      try:
        # utf-8-sig: a byte-order mark some editors write is not part of the first row.
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 (byte {e.start + 1} of the line, "
                           f"{raw[e.start:e.start + 1]!r}); the text would be changed") from None
      if not line.strip():
        continue
      try:
        rows.append((where, json.loads(line)))
      except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not a JSON line ({e.msg})") from None
      except RecursionError:
        raise DatasetError(f"{where}: JSON nested too deeply to read") from None
      except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DatasetError(f"{where}: not a readable JSON line ({e})") from None
  return rows


def _parquet_rows(path: pathlib.Path) -> list[tuple[str, Any]]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DatasetError("reading parquet needs pyarrow (pip install pyarrow)") from None
  try:
    rows = pq.read_table(path).to_pylist()
  except Exception as e:  # pyarrow raises several types for a bad file
    raise DatasetError(f"dataset {path} is not a readable parquet file: {e}") from None
  return [(f"{path}: row {number}", row) for number, row in enumerate(rows, 1)]


def _checked_rows(path: str | pathlib.Path,
                  metrics: Collection[str] | None) -> list[tuple[str, dict]]:
  """(where, row) of every row, each checked against the schema; ids unique."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DatasetError(f"dataset {path} does not exist")
  rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
  if not rows:
    raise DatasetError(f"dataset {path} has no rows")
  rows = [(where, check_row(row, where, metrics)) for where, row in rows]
  seen: dict[str, str] = {}
  for index, (where, row) in enumerate(rows):
    key = _row_id(row, index)
    if key in seen:
      place = where.rpartition(": ")[2]
      raise DatasetError(f"{seen[key]} and {place} share the id {key!r}; each row's id "
                         "must be unique (results are kept by id)")
    seen[key] = where
  return rows


def read_rows(path: str | pathlib.Path, metrics: Collection[str] | None = None) -> list[dict]:
  """The rows of a .jsonl / .json-lines or .parquet file, checked against SCHEMA.

  Args:
    path: the dataset file.
    metrics: the metric names a row may give (None: any name).

  Raises:
    DatasetError: the file is missing, unreadable or empty, a line is not
      JSON, a row breaks the schema (the message names the file, line or row,
      and field), or two rows share an id.
  """
  return [row for _, row in _checked_rows(path, metrics)]


def _row_id(row: dict, index: int) -> str:
  """The row's id, or its 0-based index when it gives none."""
  return str(row["id"]) if row.get("id") is not None else str(index)


def dataset_samples(tokenizer, path: str | pathlib.Path, *, metric: str = "qa_f1",
                    max_new_tokens: int = 32, max_tokens: int | None = None,
                    metrics: Collection[str] | None = None) -> list[Sample]:
  """Samples of a local dataset: the context in a user turn, then the question.

  Args:
    metric: the metric of rows that do not name one.
    max_new_tokens: the generation length of rows that do not give one.
    max_tokens: contexts of longer prompts lose their middle (LongBench's rule)
      until the prompt fits.
    metrics: the metric names a row may give (None: any name).

  Raises:
    DatasetError: as ``read_rows``.
  """
  samples = []
  for index, (_, row) in enumerate(_checked_rows(path, metrics)):
    context, question = row["context"], row["question"]
    answer = row["answer"]
    fields = dict(answers=(answer,) if isinstance(answer, str) else tuple(answer),
                  task="dataset", id=_row_id(row, index), metric=row.get("metric") or metric,
                  max_new_tokens=int(row.get("max_new_tokens") or max_new_tokens),
                  all_classes=tuple(row.get("all_classes") or ()))
    prefix = row.get("answer_prefix") or ""
    sample = chat_sample(tokenizer, "", context, question, answer_prefix=prefix, **fields)
    if max_tokens is not None and sample.num_tokens > max_tokens:
      ids = tokenizer.encode(context)
      keep = max(0, len(ids) - (sample.num_tokens - max_tokens) - 8)  # 8: re-tokenizing slack
      context = tokenizer.decode(ids[:keep // 2]) + tokenizer.decode(ids[len(ids) - keep // 2:])
      sample = chat_sample(tokenizer, "", context, question, answer_prefix=prefix, **fields)
    samples.append(sample)
  return samples
