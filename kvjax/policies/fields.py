"""Hyper-parameters that several policies share, as dataclass mixins.

A policy lists a mixin before ``Policy`` among its bases and gets the fields
(the same names in every policy, so ``kvjax.policies.get(name, window=16)``
and ``kvjax.policies.window_fields`` work alike for all), their checks on
creation, and what the fields drive:

  WindowFields     window, kernel, group: SnapKV's observation-window scorer
                   (``self.scorer``), the window kept, the token scores
  DelimiterFields  delimiter_ids: cut points from the prompt's tokens, filled
                   from the tokenizer by ``bind`` when empty

Mixins come before ``Policy`` (``class SABlock(DelimiterFields, WindowFields,
Policy)``) so their fields come first and their checks run in base order.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from kvjax.policies import delimiters
from kvjax.policies import scoring


@dataclasses.dataclass(frozen=True)
class WindowFields:
  """A policy that scores tokens by SnapKV's observation window (mixed with ``Policy``)."""

  window: int = 64  # last prompt tokens whose queries score the rest; always kept
  kernel: int = 5  # average-pooling width over token scores
  group: str = "mean"  # reduction over the query heads of a KV head: mean or max

  def __post_init__(self):
    super().__post_init__()
    self._check_int("window", 1)
    self._check_int("kernel", 1, odd=True)
    self._check_choice("group", scoring.GROUP_REDUCTIONS)

  @property
  def scorer(self) -> scoring.WindowScorer:
    return scoring.WindowScorer(self.window, self.kernel, self.group)

  def reserved(self):
    return self.window

  def score(self, ex, prompt, q, k, v):
    del v
    return self.scorer.scores(ex, q, k, prompt.lengths)


@dataclasses.dataclass(frozen=True)
class DelimiterFields:
  """A policy that cuts the prompt after delimiter tokens (mixed with ``Policy``).

  Subclasses set which tokens ``bind`` takes from the tokenizer: those whose
  text ends with (``delimiters_anywhere``: contains) one of ``delimiter_chars``.
  """

  delimiter_chars: ClassVar[tuple[str, ...]] = delimiters.SENTENCE_END
  delimiters_anywhere: ClassVar[bool] = False
  delimiter_ids: tuple[int, ...] = ()  # cut-point tokens; from the tokenizer when empty

  def __post_init__(self):
    super().__post_init__()
    self._check_token_ids("delimiter_ids")

  def bind(self, tokenizer):
    if self.delimiter_ids or tokenizer is None:
      return self
    return dataclasses.replace(self, delimiter_ids=delimiters.delimiter_ids(
        tokenizer, self.delimiter_chars, anywhere=self.delimiters_anywhere))

  def is_delimiter(self, tokens: jax.Array | None) -> jax.Array:
    """bool [B, T]: the prompt token is a delimiter. Raises ValueError without ids or tokens."""
    if not self.delimiter_ids or tokens is None:
      raise ValueError(f"{self.name} needs delimiter_ids (pass a tokenizer) and the prompt "
                       "tokens")
    return delimiters.is_delimiter(tokens, self.delimiter_ids)
