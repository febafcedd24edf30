"""The passkey retrieval prompt: a number hidden at a chosen depth of filler text.

The format is one on which SmolLM2-135M-Instruct retrieves the key with the full
cache (measured: 100% at 1K-4K tokens): a system-less ChatML user turn with the
instruction first, the haystack with the needle, and the question last.
"""

from __future__ import annotations

import dataclasses

import numpy as np

INSTRUCTION = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about the pass key.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? Answer with the number only."


@dataclasses.dataclass(frozen=True)
class Sample:
  prompt: str  # the full prompt text, chat markup included
  answer: str  # the expected answer
  num_tokens: int  # prompt length in tokens
  depth: float  # where the needle sits, as a fraction of the haystack


def passkey_prompt(tokenizer, *, context_tokens: int, depth: float = 0.5, seed: int = 0) -> Sample:
  """A passkey prompt of about ``context_tokens`` tokens (never more).

  Args:
    tokenizer: a kvjax Tokenizer (uses ``encode`` and ``chatml``).
    context_tokens: target prompt length in tokens, markup included.
    depth: needle position as a fraction of the filler, 0 (start) to 1 (end).
    seed: picks the 5-digit key.
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  key = str(np.random.default_rng(seed).integers(10000, 100000))
  needle = f"The pass key is {key}. Remember it. {key} is the pass key."

  def build(n_filler: int) -> str:
    units = [FILLER] * n_filler
    units.insert(round(depth * n_filler), needle)
    content = f"{INSTRUCTION}\n" + " ".join(units) + f"\n{QUESTION}"
    return tokenizer.chatml([{"role": "user", "content": content}])

  count = lambda n: len(tokenizer.encode(build(n)))
  base = count(0)
  if base > context_tokens:
    raise ValueError(f"context_tokens={context_tokens} is below the {base} tokens of the "
                     "instruction, needle and question")
  per_unit = max(1, count(1) - base)
  n = max(0, (context_tokens - base) // per_unit)
  while n > 0 and count(n) > context_tokens:
    n -= 1
  while count(n + 1) <= context_tokens:
    n += 1
  prompt = build(n)
  return Sample(prompt, key, len(tokenizer.encode(prompt)), depth)
