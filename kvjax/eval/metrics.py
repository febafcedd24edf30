"""Scores of a prediction against expected answers, each in [0, 1].

  contains        NIAH tasks: the fraction of expected strings found verbatim
                  in the prediction (RULER's string match, all answers).
  qa_f1           LongBench's QA F1: token F1 after normalisation (lower case,
                  no punctuation, no articles), best over the answers.
  rouge_l         LongBench's summarisation metric: ROUGE-L F1 over words,
                  best over the answers.
  classification  LongBench's: the expected label among the labels named in
                  the prediction, 1 / (labels named) when it is there. The
                  candidate labels come from the row's ``all_classes``.
  retrieval       LongBench's passage retrieval: of the numbers in the
                  prediction, the fraction equal to the answer's paragraph number.
  code_sim        LongBench's code completion: edit similarity of the first
                  line of the prediction without a comment or code-fence mark
                  (the indel ratio, as rapidfuzz's fuzz.ratio / 100).

A prediction counts as correct when its score is 1 for ``contains``, and when
it is at least 0.5 for the others (reported next to the mean score).
"""

from __future__ import annotations

import collections
import re
import string
from typing import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
  """Lower case, without punctuation, articles and extra whitespace (SQuAD's rule)."""
  text = "".join(c for c in text.lower() if c not in set(string.punctuation))
  return " ".join(_ARTICLES.sub(" ", text).split())


def contains(prediction: str, answers: Sequence[str], **_) -> float:
  return sum(a in prediction for a in answers) / len(answers)


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
  common = collections.Counter(pred_tokens) & collections.Counter(ref_tokens)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred_tokens), same / len(ref_tokens)
  return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str], **_) -> float:
  pred = normalize_answer(prediction).split()
  return max(_f1(pred, normalize_answer(a).split()) for a in answers)


def _lcs(a: Sequence, b: Sequence) -> int:
  """Length of the longest common subsequence (O(len(a) * len(b)), rows of b)."""
  row = [0] * (len(b) + 1)
  for x in a:
    prev_diag = 0
    for j, y in enumerate(b, 1):
      prev_diag, row[j] = row[j], (prev_diag + 1 if x == y else max(row[j], row[j - 1]))
  return row[-1]


def rouge_l(prediction: str, answers: Sequence[str], **_) -> float:
  pred = prediction.lower().split()

  def one(answer: str) -> float:
    ref = answer.lower().split()
    lcs = _lcs(pred, ref)
    if lcs == 0:
      return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)

  return max(one(a) for a in answers)


def classification(prediction: str, answers: Sequence[str], *,
                   all_classes: Sequence[str] | None = None, **_) -> float:
  if not all_classes:
    raise ValueError("the classification metric needs the row's all_classes")

  def one(answer: str) -> float:
    named = [c for c in all_classes if c in prediction]
    # A label that is part of the expected one (e.g. "ball" in "football") is not a rival.
    named = [c for c in named if not (c in answer and c != answer)]
    return 1.0 / len(named) if answer in named else 0.0

  return max(one(a) for a in answers)


def retrieval(prediction: str, answers: Sequence[str], **_) -> float:
  def one(answer: str) -> float:
    wanted = re.findall(r"Paragraph (\d+)", answer) or re.findall(r"\d+", answer)
    numbers = re.findall(r"\d+", prediction)
    if not wanted or not numbers:
      return 0.0
    return sum(n == wanted[0] for n in numbers) / len(numbers)

  return max(one(a) for a in answers)


def edit_similarity(a: str, b: str) -> float:
  """1 - indel distance / (len a + len b): 2 * LCS / (len a + len b)."""
  if not a and not b:
    return 1.0
  return 2 * _lcs(a, b) / (len(a) + len(b))


def code_sim(prediction: str, answers: Sequence[str], **_) -> float:
  lines = [l for l in prediction.lstrip("\n").split("\n")
           if not any(mark in l for mark in ("`", "#", "//"))]
  first = lines[0] if lines else prediction  # LongBench keeps the whole text then
  return max(edit_similarity(first, a) for a in answers)


METRICS: dict[str, Callable[..., float]] = {
    "contains": contains,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "code_sim": code_sim,
}


def score(metric: str, prediction: str, answers: Sequence[str], **row) -> tuple[float, bool]:
  """(score in [0, 1], correct) of a prediction under a named metric."""
  if metric not in METRICS:
    raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
  if not answers:
    raise ValueError("a sample needs at least one expected answer")
  value = float(METRICS[metric](prediction, list(answers), **row))
  return value, (value == 1.0 if metric == "contains" else value >= 0.5)
