"""generate's arguments checked, and its prompts tokenized and padded.

Every check runs before any work is done, so a bad argument costs no
compilation and no memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from kvjax import execution
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
  pad_multiple: int  # prompts are right-padded to a multiple of this
  attention_block: int  # block size of the one-shot prefill's causal attention
  prefill_chunk: int  # tokens per prefill chunk; 0 for a one-shot prefill
  stop_ids: tuple[int, ...]  # ids that end a sequence
  temperature: float  # 0 for greedy
  top_k: int  # sample among the k most likely tokens (0 = all)
  seed: int
  mesh: Any = None  # a (data, model) jax.sharding.Mesh to run on, or None for one device
  decode_block: int | None = None  # decode steps per host round trip (None: the platform's)
  # The programs' kernels and platform (``kvjax.execution.create``; XLA by default).
  ex: execution.Execution = execution.Execution()


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
  # [B, 2] int32 positions [start, end) of each question, appended or inside the
  # prompt (query-aware); [0, 0) without one. Page eviction never takes them.
  question_span: np.ndarray

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
  cfg = lm.config
  for name in ("max_new_tokens", "page_size", "pad_multiple", "attention_block"):
    value = getattr(options, name)
    if not _is_int(value) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  block = options.decode_block
  if block is not None and (not _is_int(block) or block < 1):
    raise ValueError(f"decode_block must be a positive int (or None), got {block!r}")
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
  if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
      or not np.isfinite(temperature) or temperature < 0):
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if not _is_int(top_k) or not 0 <= top_k <= cfg.vocab_size:
    raise ValueError(f"top_k must be an int in [0, {cfg.vocab_size}], got {top_k!r}")
  if not _is_int(options.seed):
    raise ValueError(f"seed must be an int, got {options.seed!r}")
  for token in options.stop_ids:
    if not _is_int(token) or not 0 <= token < cfg.vocab_size:
      raise ValueError(f"stop_ids must be token ids in [0, {cfg.vocab_size}), got {token!r}")
  return runs


def batch(lm: LanguageModel, prompts: Prompts, questions: Prompts | None, *, query_aware: bool,
          chat_template: bool, options: Options) -> Batch:
  """Tokenizes and pads the prompts (and questions).

  With ``chat_template`` each string prompt becomes a user turn of the model's
  template, its question in the same turn (``_chat_turns``).

  Raises:
    ValueError: an empty or out-of-vocabulary prompt, ids that are not ints, a
      question count that is not the prompt count, or a prompt too long for
      the model's context.
  """
  for name, flag in (("query_aware", query_aware), ("chat_template", chat_template)):
    if not isinstance(flag, (bool, np.bool_)):
      raise ValueError(f"{name} must be True or False, got {flag!r}")
  prompts, questions = _as_list(prompts, "prompts"), (
      None if questions is None else _as_list(questions, "questions"))
  if questions is not None and len(questions) != len(prompts):
    raise ValueError(f"{len(prompts)} prompts but {len(questions)} questions")
  if chat_template:
    prompts, questions = _chat_turns(lm, prompts, questions)
  ids = _tokenize(lm, prompts, "prompt")
  question_ids = None
  span = np.zeros((len(ids), 2), np.int32)
  if questions is not None:
    question_ids = _tokenize(lm, questions, "question")
    span[:, 0] = [len(p) for p in ids]
    span[:, 1] = span[:, 0] + [len(q) for q in question_ids]
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
               q_lengths, span)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_list(prompts: Prompts, name: str) -> list:
  """One string as a batch of one; a list (or numpy [B, T] ids) as a list; else ValueError."""
  if isinstance(prompts, str):
    return [prompts]
  if not isinstance(prompts, (Sequence, np.ndarray)) or isinstance(prompts, bytes):
    raise ValueError(f"{name} must be a string, a list of strings or a list of token-id "
                     f"lists, got {type(prompts).__name__}")
  if not len(prompts):
    raise ValueError(f"{name} is empty")
  return list(prompts)


# Stands for the question while the chat template renders, so the turn can be
# cut where the question starts whatever markup the template adds around it.
_QUESTION_MARK = "\ue000kvjax-question\ue000"


def _chat_turns(lm: LanguageModel, prompts: list, questions: list | None):
  """Each prompt (and its question) as one user turn of the model's chat template.

  The context comes first and the question after it, in the same turn, then
  the assistant's header. The rendered text is cut where the question starts:
  the context's part (the template's head and the context) and the question's
  part ("\\n", the question, the turn's end and the assistant's header), so
  query-agnostic runs compress the context alone and append the rest.

  Returns:
    (contexts, questions): rendered strings; questions None without questions.
  """
  lm.require_tokenizer("chat prompts")
  for name, texts in (("prompt", prompts), ("question", questions or ())):
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise ValueError(f"chat_template=True takes string prompts and questions; "
                         f"{name} {i} is {type(text).__name__}")
  if questions is None:
    return [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in prompts], None
  contexts, tails = [], []
  for context, question in zip(prompts, questions):
    turn = f"{context}\n{_QUESTION_MARK}"
    rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": turn}])
    head, sep, tail = rendered.rpartition(_QUESTION_MARK)
    if not sep:
      raise ValueError("the model's chat template drops the user's text; pass prompts "
                       "rendered with lm.tokenizer.chatml(...) and chat_template=False")
    cut = len(head) - 1 if head.endswith("\n") else len(head)
    contexts.append(head[:cut])
    tails.append(head[cut:] + question + tail)
  return contexts, tails


def _tokenize(lm: LanguageModel, prompts: list, name: str) -> list[list[int]]:
  """Token ids of each prompt: strings encoded, id lists checked (ints in the vocabulary).

  A prompt string starts with BOS where the model's tokenizer says so (Gemma);
  a question, appended after it, never does.
  """
  ids = []
  vocab = lm.config.vocab_size
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      row = lm.require_tokenizer(f"{name} {i} (a string)").encode(
          p, add_bos=None if name == "prompt" else False)
    else:
      row = _token_ids(p, f"{name} {i}", vocab)
    if not row:
      raise ValueError(f"{name} {i} is empty")
    ids.append(row)
  return ids


def _token_ids(row, name: str, vocab: int) -> list[int]:
  """A prompt given as ids: ints (numpy ints too) in [0, vocab); floats and strings refused."""
  if isinstance(row, bytes) or not isinstance(row, (Sequence, np.ndarray)):
    raise ValueError(f"{name} must be a string or a list of token ids, got {type(row).__name__}")
  for t in row:
    if not _is_int(t):
      raise ValueError(f"{name} has a token id {t!r} of type {type(t).__name__}; ids are ints")
  row = [int(t) for t in row]
  if any(t < 0 or t >= vocab for t in row):
    raise ValueError(f"{name} has token ids outside [0, {vocab})")
  return row


def _pad(rows: list[list[int]], multiple: int) -> np.ndarray:
  """Right-pads token rows to one length, a multiple of ``multiple``: [B, T] int32."""
  tokens = np.zeros((len(rows), round_up(max(len(r) for r in rows), multiple)), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens
