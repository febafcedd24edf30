"""Needle-in-a-haystack tasks (RULER-style), each a prompt of a chosen token length.

  niah               one needle: the pass key in "repeat" filler, a magic
                     number for a named key in "natural" filler
  niah_multikey      four needles with different keys; the question asks for one
  niah_multivalue    four values for one key; the answer must name all four
  variable_tracking  a value assigned to a variable, then copied along a chain
                     of variables; the answer must name every variable in it

``depth`` places the needle that is asked about (for variable tracking, the
first assignment); the other needles are spread at seeded random depths.
Prompts are system-less user turns (ChatML, or Gemma's turns) with the instruction first and the
question last, the format on which SmolLM2-135M retrieves with the full cache.
"""

from __future__ import annotations

import numpy as np

from kvjax.tasks import haystack as haystack_lib
from kvjax.tasks.sample import Sample
from kvjax.tasks.sample import chat_sample

TASKS = ("niah", "niah_multikey", "niah_multivalue", "variable_tracking")
_KEYS = ("apple", "river", "lantern", "meadow", "copper", "falcon", "harbor", "violet",
         "glacier", "cinnamon", "orbit", "thimble", "canyon", "saffron", "marble", "tundra")
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
NUM_NEEDLES = 4  # needles of the multi-key, multi-value and variable-tracking tasks


def _number(rng) -> str:
  return str(int(rng.integers(10000, 100000)))


def _spread(rng, n: int, depth: float) -> list[float]:
  """``depth`` first, then n - 1 other depths drawn from [0, 1]."""
  return [depth] + [float(x) for x in rng.uniform(0.0, 1.0, n - 1)]


def _layout(task: str, kind: str, depth: float, rng):
  """(instruction, needles [(depth, text)], question, answers, the answer's lead-in)."""
  if task == "niah" and kind == "repeat":
    key = _number(rng)
    return ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
            "it. I will quiz you about the pass key.",
            [(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")],
            "What is the pass key? Answer with the number only.", (key,), "The pass key is")
  names = [str(x) for x in rng.choice(_KEYS, NUM_NEEDLES, replace=False)]
  values = [_number(rng) for _ in range(NUM_NEEDLES)]
  fact = lambda name, value: (f"The special magic number for {name} is {value}. "
                              f"Remember it. {value} is the special magic number for {name}.")
  intro = ("Special magic numbers are hidden inside a long text. Find them and memorize them. "
           "I will quiz you about them.")
  lead_in = f"The special magic number for {names[0]} is"
  if task == "niah":
    return (intro, [(depth, fact(names[0], values[0]))],
            f"What is the special magic number for {names[0]}? Answer with the number only.",
            (values[0],), lead_in)
  if task == "niah_multikey":
    depths = _spread(rng, NUM_NEEDLES, depth)
    return (intro, [(d, fact(n, v)) for d, n, v in zip(depths, names, values)],
            f"What is the special magic number for {names[0]}? Answer with the number only.",
            (values[0],), lead_in)
  if task == "niah_multivalue":
    depths = _spread(rng, NUM_NEEDLES, depth)
    return (intro, [(d, fact(names[0], v)) for d, v in zip(depths, values)],
            f"What are all the special magic numbers for {names[0]}? Answer with the numbers "
            "only, separated by commas.", tuple(values),
            f"The special magic numbers for {names[0]} are")
  if task == "variable_tracking":
    variables = ["".join(rng.choice(_LETTERS, 5)) for _ in range(NUM_NEEDLES)]
    # The chain runs forward: each copy sits after the assignment it copies.
    later = sorted(float(x) for x in rng.uniform(depth, 1.0, NUM_NEEDLES - 1))
    needles = [(depth, f"VAR {variables[0]} = {values[0]}.")]
    needles += [(d, f"VAR {variables[i + 1]} = VAR {variables[i]}.")
                for i, d in enumerate(later)]
    return ("Memorize and track the chain of variable assignments hidden in the following text.",
            needles,
            f"Which variables are assigned the value {values[0]}? Answer with the variable "
            "names only, separated by commas.", tuple(variables),
            f"The variables assigned the value {values[0]} are")
  raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def make_sample(tokenizer, task: str, *, length: int, depth: float = 0.5,
                haystack: str = "repeat", seed: int = 0, index: int = 0,
                lead_in: bool | None = None) -> Sample:
  """A ``task`` prompt of at most ``length`` tokens (within a token or two of it).

  Args:
    tokenizer: a kvjax Tokenizer.
    task: one of TASKS.
    length: prompt length in tokens, chat markup included.
    depth: where the asked needle sits, as a fraction of the haystack.
    haystack: "repeat" or "natural" filler.
    seed, index: the sample's randomness (keys, values, filler, other depths).
    lead_in: end the prompt, after the assistant's turn opens, with the answer's
      first words and a space ("The pass key is "; without the space Gemma 3
      270M wrote the instruction's words on): a base model completes text rather than
      follow the question, and answers after them. None: where the tokenizer
      ships no chat template (a base model's, as Gemma 3 270M's GGUF).
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  if haystack not in haystack_lib.KINDS:
    raise ValueError(f"haystack must be one of {haystack_lib.KINDS}, got {haystack!r}")
  rng = np.random.default_rng([seed, index, TASKS.index(task), haystack_lib.KINDS.index(haystack),
                               round(depth * 1000), length])
  instruction, needles, question, answers, prefix = _layout(task, haystack, depth, rng)
  if lead_in is None:
    lead_in = not tokenizer.has_chat_template
  filler_seed = int(rng.integers(2**31))

  def build(n: int, words: int = 0) -> Sample:
    units = haystack_lib.filler_units(haystack, n, filler_seed, words)
    return chat_sample(tokenizer, instruction, haystack_lib.insert_needles(units, needles),
                       question, answer_prefix=f"{prefix} " if lead_in else "", answers=answers,
                       depth=depth, task=task, haystack=haystack,
                       target_tokens=length,
                       id=f"{task}-{haystack}-{length}-{depth:g}-{seed}-{index}",
                       max_new_tokens=8 * len(answers) + 8)

  n = haystack_lib.fit(lambda n: build(n).num_tokens, length)
  # Top up with the words of a partial sentence (a sentence is 4-20 tokens).
  words = haystack_lib.fit(lambda w: build(n, w).num_tokens, length)
  return build(n, words)
