"""Local long-context datasets in kvpress's benchmark schema (JSONL or parquet).

Each row has ``context``, ``question`` and ``answer`` (a string or a list of
acceptable strings); optional ``answer_prefix`` (appended after the
assistant's turn starts), ``max_new_tokens``, ``id``, ``metric`` (overrides
the evaluation's metric for that row) and ``all_classes`` (the candidate
labels of classification tasks). kvpress exports its benchmarks (RULER,
LongBench, InfiniteBench, ...) in this schema.
"""

from __future__ import annotations

import json
import pathlib

from kvjax.tasks.sample import Sample
from kvjax.tasks.sample import chat_sample

REQUIRED = ("context", "question", "answer")


class DatasetError(ValueError):
  """The file cannot be read or a row does not follow the schema."""


def read_rows(path: str | pathlib.Path) -> list[dict]:
  """The rows of a .jsonl / .json-lines or .parquet file, checked against the schema."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DatasetError(f"dataset {path} does not exist")
  if path.suffix == ".parquet":
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise DatasetError("reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
      rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a bad file
      raise DatasetError(f"dataset {path} is not a readable parquet file: {e}") from None
  else:
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise DatasetError(f"{path}:{number}: not a JSON line ({e.msg})") from None
  if not rows:
    raise DatasetError(f"dataset {path} has no rows")
  for number, row in enumerate(rows, 1):
    if not isinstance(row, dict):
      raise DatasetError(f"{path}: row {number} is not an object")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
      raise DatasetError(f"{path}: row {number} lacks {missing} (needs {list(REQUIRED)})")
  return rows


def _answers(answer) -> tuple[str, ...]:
  if isinstance(answer, str):
    return (answer,)
  answers = tuple(str(a) for a in answer)
  if not answers:
    raise DatasetError("a row's answer list is empty")
  return answers


def dataset_samples(tokenizer, path: str | pathlib.Path, *, metric: str = "qa_f1",
                    max_new_tokens: int = 32, max_tokens: int | None = None) -> list[Sample]:
  """Samples of a local dataset: the context in a user turn, then the question.

  Args:
    metric: the metric of rows that do not name one.
    max_new_tokens: the generation length of rows that do not give one.
    max_tokens: contexts of longer prompts lose their middle (LongBench's rule)
      until the prompt fits.
  """
  samples = []
  for number, row in enumerate(read_rows(path)):
    context, question = str(row["context"]), str(row["question"])
    fields = dict(answers=_answers(row["answer"]), task="dataset",
                  id=str(row.get("id", number)), metric=str(row.get("metric") or metric),
                  max_new_tokens=int(row.get("max_new_tokens") or max_new_tokens),
                  all_classes=tuple(str(c) for c in row.get("all_classes") or ()))
    prefix = str(row.get("answer_prefix") or "")
    sample = chat_sample(tokenizer, "", context, question, answer_prefix=prefix, **fields)
    if max_tokens is not None and sample.num_tokens > max_tokens:
      ids = tokenizer.encode(context)
      keep = max(0, len(ids) - (sample.num_tokens - max_tokens) - 8)  # 8: re-tokenizing slack
      context = tokenizer.decode(ids[:keep // 2]) + tokenizer.decode(ids[len(ids) - keep // 2:])
      sample = chat_sample(tokenizer, "", context, question, answer_prefix=prefix, **fields)
    samples.append(sample)
  return samples
