"""A request to the serving engine and the completion it gets back."""

from __future__ import annotations

import dataclasses
import math
import re

_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_bytes(size: str | int) -> int:
  """Bytes of ``size``: an int, or a string like "4GiB", "512MiB", "1.5GB".

  Raises:
    ValueError: anything else, or a size that is not positive.
  """
  if isinstance(size, int) and not isinstance(size, bool):
    value = size
  else:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
      raise ValueError(f"kv_memory must be bytes as an int or like '4GiB', got {size!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
  if value <= 0:
    raise ValueError(f"kv_memory must be positive, got {size!r}")
  return value


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to complete, as the engine queues it."""

  id: int
  ids: tuple[int, ...]  # the prompt's token ids
  max_tokens: int  # tokens to generate at most (a stop id counts)
  temperature: float  # 0: greedy
  top_k: int  # sample among the k most likely tokens (0: all)
  seed: int  # the draws' seed (temperature > 0)
  stop: tuple[str, ...]  # strings that end the completion (the text up to them is kept)
  stop_ids: tuple[int, ...]  # ids that end it (the tokenizer's stop ids among them)

  @classmethod
  def checked(cls, request_id: int, ids, *, max_tokens, temperature, top_k, seed, stop,
              stop_ids, max_prompt: int, max_new: int, vocab: int) -> "Request":
    """The request, or ValueError naming the bad value."""
    if len(ids) > max_prompt:
      raise ValueError(f"prompt of {len(ids)} tokens exceeds the engine's max_prompt_tokens "
                       f"of {max_prompt}")
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_new:
      raise ValueError(f"max_tokens must be an int in [1, {max_new}], got {max_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature) or temperature < 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_int(top_k) or not 0 <= top_k <= vocab:
      raise ValueError(f"top_k must be an int in [0, {vocab}], got {top_k!r}")
    if not _is_int(seed) or not 0 <= seed < 2 ** 32:
      raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if not all(isinstance(s, str) and s for s in stop):
      raise ValueError(f"stop must be non-empty strings, got {stop!r}")
    if not all(_is_int(t) and 0 <= t < vocab for t in stop_ids):
      raise ValueError(f"stop_ids must be token ids, got {stop_ids!r}")
    return cls(request_id, tuple(int(t) for t in ids), int(max_tokens), float(temperature),
               int(top_k), int(seed), tuple(stop), tuple(dict.fromkeys(int(t) for t in stop_ids)))


@dataclasses.dataclass(frozen=True)
class Completion:
  """What a request generated."""

  id: int
  token_ids: list[int]  # up to and including a stop id
  text: str  # decoded, cut before a stop string
  finish_reason: str  # "stop" (a stop id or string) or "length" (max_tokens)
  prompt_tokens: int

  @classmethod
  def of(cls, request: Request, tokens: list[int], text: str) -> "Completion":
    cut = min((text.index(s) for s in request.stop if s in text), default=None)
    ended = (bool(tokens) and tokens[-1] in request.stop_ids) or cut is not None
    return cls(request.id, list(tokens), text if cut is None else text[:cut],
               "stop" if ended else "length", len(request.ids))


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)
