"""How much of a needle a compressed cache still holds (diagnostics for NIAH misses)."""

from __future__ import annotations

import numpy as np


def answer_span(tokenizer, context: str, answer: str) -> np.ndarray:
  """Token indices of ``context`` (as ``tokenizer.encode`` splits it) that overlap ``answer``.

  Raises:
    ValueError: the answer is not in the context, or the tokenizer's offsets
      disagree with its ``encode``.
  """
  encoding = tokenizer.backend.encode(context, add_special_tokens=False)
  if list(encoding.ids) != tokenizer.encode(context):
    raise ValueError("the tokenizer's offsets do not match its encode()")
  start = context.find(answer)
  if start < 0:
    raise ValueError(f"answer {answer!r} is not in the context")
  stop = start + len(answer)
  return np.array([i for i, (a, b) in enumerate(encoding.offsets) if a < stop and b > start])


def retention(kept_positions: np.ndarray, span: np.ndarray) -> tuple[float, float]:
  """(mean fraction of ``span`` kept per head, fraction of heads keeping all of it).

  Args:
    kept_positions: [L, K, S] original positions per slot (-1 = empty), one
      sequence of ``PagedKVCache.kept_positions()``.
    span: [n] the answer's token positions.
  """
  held = np.array([[np.isin(span, head).mean() for head in layer] for layer in kept_positions])
  return float(held.mean()), float((held == 1).mean())
