"""generate's arguments checked, and its prompts tokenized and padded.

Every check runs before any work is done, so a bad argument costs no
compilation and no memory.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from kvjax import backend as backend_lib
from kvjax import policies as policies_lib
from kvjax.cache.paged import round_up
from kvjax.models.lm import LanguageModel

Run = tuple[policies_lib.Policy, int | None]  # (policy, budget: None for "full")
Prompts = str | Sequence[str] | Sequence[Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Options:
  """The options every run of one generate call shares (as given: ``check`` checks them)."""

  max_new_tokens: int  # tokens generated per sequence (sets the output shape)
  page_size: int  # slots per cache page
  backend: str  # the caller's kernel backend ("auto" resolves op by op)
  pad_multiple: int  # prompts are right-padded to a multiple of this
  attention_block: int  # block size of the one-shot prefill's causal attention
  prefill_chunk: int  # tokens per prefill chunk; 0 for a one-shot prefill
  stop_ids: tuple[int, ...]  # ids that end a sequence
  temperature: float  # 0 for greedy
  top_k: int  # sample among the k most likely tokens (0 = all)
  seed: int


@dataclasses.dataclass(frozen=True)
class Batch:
  """A batch's prompts (and questions) as token ids, right-padded.

  Questions appear here only when they are appended after the prompt's
  compression (query-agnostic); query-aware ones are part of the prompt.
  """

  tokens: np.ndarray  # [B, T] int32, T a multiple of the padding (or of the prefill chunk)
  lengths: np.ndarray  # [B] int32 prompt tokens per sequence
  question_tokens: np.ndarray | None  # [B, Q] int32, or None without questions to append
  question_lengths: np.ndarray  # [B] int32 (zeros without questions to append)

  @property
  def size(self) -> int:
    return self.tokens.shape[0]

  @property
  def prompt_len(self) -> int:
    """T: the padded prompt length."""
    return self.tokens.shape[1]

  @property
  def question_len(self) -> int:
    """Q: the padded question length (0 without questions to append)."""
    return 0 if self.question_tokens is None else self.question_tokens.shape[1]

  @property
  def next_positions(self) -> np.ndarray:
    """[B] int32 position of each sequence's first generated token."""
    return self.lengths + self.question_lengths


def check(lm: LanguageModel, runs: Sequence[tuple[str | policies_lib.Policy, int | None]],
          options: Options) -> list[Run]:
  """Checks the runs and the options; returns the runs' policies bound to the tokenizer.

  Raises:
    ValueError: the first bad argument.
  """
  runs = [(policies_lib.get(policy), budget) for policy, budget in runs]
  if not runs:
    raise ValueError("runs is empty: pass at least one (policy, budget) pair")
  backend_lib.resolve(options.backend)
  cfg = lm.config
  for name in ("max_new_tokens", "page_size", "pad_multiple", "attention_block"):
    value = getattr(options, name)
    if not _is_int(value) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  chunk = options.prefill_chunk
  if not _is_int(chunk) or chunk < 0:
    raise ValueError(f"prefill_chunk must be a positive int (or 0 for one shot), got {chunk!r}")
  for policy, budget in runs:
    policy.validate(budget)
    if chunk:
      policy.check_chunk(chunk)
    if budget is not None and budget > cfg.max_position_embeddings:
      # No sequence can ever hold more entries than the model's context: such a
      # budget is a typo (or a token count mistaken for something else).
      raise ValueError(f"budget {budget} exceeds the model's context of "
                       f"{cfg.max_position_embeddings} tokens")
  runs = [(policy.bind(lm.tokenizer), budget) for policy, budget in runs]
  temperature, top_k = options.temperature, options.top_k
  if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if not _is_int(top_k) or not 0 <= top_k <= cfg.vocab_size:
    raise ValueError(f"top_k must be an int in [0, {cfg.vocab_size}], got {top_k!r}")
  return runs


def batch(lm: LanguageModel, prompts: Prompts, questions: Prompts | None, *, query_aware: bool,
          chat_template: bool, options: Options) -> Batch:
  """Tokenizes and pads the prompts (and questions).

  Raises:
    ValueError: an empty or out-of-vocabulary prompt, a question count that is
      not the prompt count, or a prompt too long for the model's context.
  """
  ids = _tokenize(lm, prompts, chat_template)
  question_ids = None
  if questions is not None:
    question_ids = _tokenize(lm, questions, False)
    if len(question_ids) != len(ids):
      raise ValueError(f"{len(ids)} prompts but {len(question_ids)} questions")
    if query_aware:
      ids, question_ids = [p + q for p, q in zip(ids, question_ids)], None
  q_lengths = np.array([len(x) for x in question_ids or [[]] * len(ids)], np.int32)
  lengths = np.array([len(x) for x in ids], np.int32)
  longest = int((lengths + q_lengths).max())
  context = lm.config.max_position_embeddings
  if longest + options.max_new_tokens > context:
    raise ValueError(f"prompt of {longest} tokens + max_new_tokens {options.max_new_tokens} "
                     f"exceeds the model's context of {context}")
  q_tokens = _pad(question_ids, options.pad_multiple) if question_ids else None
  return Batch(_pad(ids, options.prefill_chunk or options.pad_multiple), lengths, q_tokens,
               q_lengths)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _tokenize(lm: LanguageModel, prompts: Prompts, chat_template: bool) -> list[list[int]]:
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("prompts is empty")
  ids = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if lm.tokenizer is None:
        raise ValueError("this model has no tokenizer; pass token ids instead of strings")
      if chat_template:
        p = lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
      row = lm.tokenizer.encode(p)
    else:
      row = [int(t) for t in p]
      if any(t < 0 or t >= lm.config.vocab_size for t in row):
        raise ValueError(f"prompt {i} has token ids outside [0, {lm.config.vocab_size})")
    if not row:
      raise ValueError(f"prompt {i} is empty")
    ids.append(row)
  return ids


def _pad(rows: list[list[int]], multiple: int) -> np.ndarray:
  """Right-pads token rows to one length, a multiple of ``multiple``: [B, T] int32."""
  tokens = np.zeros((len(rows), round_up(max(len(r) for r in rows), multiple)), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens
