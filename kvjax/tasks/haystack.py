"""Haystacks of a chosen length in tokens, with needles at chosen depths.

Two kinds of filler, reported separately because they flatter policies
differently (a repeated filler makes keys of the filler alike, which favours
norm-based scores):
  "repeat"   the passkey literature's repeated lines ("The grass is green. ...").
  "natural"  varied sentences built from word lists by a seeded generator:
             prose-like, every sentence different, no digits (so no number in
             the filler can be mistaken for a needle's).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

KINDS = ("repeat", "natural")
REPEAT_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                    "There and back again.")

_SUBJECTS = (
    "The old fisherman", "A young teacher", "The village baker", "My neighbour", "The tired doctor",
    "A quiet student", "The ship's captain", "Her grandmother", "The museum guide", "A travelling poet",
    "The night nurse", "His younger brother", "The bus driver", "A local farmer", "The head gardener",
    "The librarian", "An engineer from the north", "The choir director", "A retired pilot",
    "The market trader", "The carpenter", "A curious child", "The mayor", "The lighthouse keeper")
_VERBS = (
    "carried", "painted", "repaired", "described", "forgot", "admired", "cleaned", "borrowed",
    "sold", "measured", "photographed", "returned", "studied", "wrapped", "polished", "searched for",
    "sketched", "delivered", "inspected", "recommended")
_OBJECTS = (
    "a wooden chair", "the blue umbrella", "an old map", "a basket of apples", "the broken clock",
    "a letter from abroad", "the garden gate", "a pair of boots", "the kitchen table",
    "a jar of honey", "the red bicycle", "a stack of newspapers", "the copper kettle",
    "a woollen scarf", "the station bench", "a bundle of firewood", "the stone bridge",
    "a box of candles", "the church bell", "a silver spoon")
_PLACES = (
    "near the harbour", "behind the bakery", "at the edge of the forest", "in the town square",
    "beside the river", "on the hill", "inside the old mill", "along the coast road",
    "under the railway arch", "at the end of the lane", "in the walled garden", "by the school")
_TIMES = (
    "early in the morning", "before lunch", "after the storm", "late in the evening",
    "on a windy afternoon", "during the festival", "at dawn", "after the market closed",
    "on the first day of spring", "while it was snowing")
_LINKS = ("Later,", "Meanwhile,", "That same week,", "Afterwards,", "Some time ago,", "Once again,")


def _natural_sentence(rng: np.random.Generator) -> str:
  pick = lambda words: words[int(rng.integers(len(words)))]
  subject, verb, obj, place, when = (pick(_SUBJECTS), pick(_VERBS), pick(_OBJECTS),
                                     pick(_PLACES), pick(_TIMES))
  form = int(rng.integers(4))
  if form == 0:
    return f"{subject} {verb} {obj} {place} {when}."
  if form == 1:
    return f"{when.capitalize()}, {subject[0].lower() + subject[1:]} {verb} {obj} {place}."
  if form == 2:
    return f"{pick(_LINKS)} {subject[0].lower() + subject[1:]} {verb} {obj}."
  return f"{subject} {verb} {obj}, and nobody {place} seemed to notice."


def filler_units(kind: str, n: int, seed: int, words: int = 0) -> list[str]:
  """The first ``n`` filler sentences of a kind (a prefix of one seeded stream).

  ``words`` > 0 appends the first that many words of sentence n + 1, so a
  prompt can be topped up to within a token or two of a target length.
  """
  if kind == "repeat":
    units = [REPEAT_SENTENCES[i % len(REPEAT_SENTENCES)] for i in range(n + 1)]
  elif kind == "natural":
    rng = np.random.default_rng([seed, 7])
    units = [_natural_sentence(rng) for _ in range(n + 1)]
  else:
    raise ValueError(f"haystack kind must be one of {KINDS}, got {kind!r}")
  partial = " ".join(units[n].split()[:words])
  return units[:n] + ([partial] if partial else [])


def insert_needles(units: Sequence[str], needles: Sequence[tuple[float, str]]) -> str:
  """Joins the units with each needle text placed at its depth (fraction of the units)."""
  placed = list(units)
  # Insert from the deepest needle up so earlier insertions do not shift later ones.
  for depth, text in sorted(needles, key=lambda x: x[0], reverse=True):
    if not 0.0 <= depth <= 1.0:
      raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    placed.insert(round(depth * len(units)), text)
  return " ".join(placed)


def fit(count_tokens: Callable[[int], int], target: int) -> int:
  """The largest n >= 0 with ``count_tokens(n) <= target`` (counts grow with n).

  Raises:
    ValueError: even n = 0 is longer than the target.
  """
  base = count_tokens(0)
  if base > target:
    raise ValueError(f"{target} tokens is below the {base} tokens the prompt needs "
                     "without any filler")
  per_unit = max(1, (count_tokens(8) - base) // 8)
  n = max(0, (target - base) // per_unit)
  while n > 0 and count_tokens(n) > target:
    n -= max(1, (count_tokens(n) - target) // per_unit)
  n = max(n, 0)
  while count_tokens(n + 1) <= target:
    n += 1
  return n
