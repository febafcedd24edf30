"""Training prompts for the gates: a pass key hidden in random filler, the answer appended.

Each prompt is a system-less ChatML user turn (the format of
``kvjax.tasks.passkey``): an instruction, filler with the pass key sentence at
a random depth, the question; then the assistant's start and the key itself,
whose tokens are the loss positions. Gates are learnt from how the model's
hidden states there depend on the distant key.

The filler is random words drawn from a list of its own (no digits, so the
key is the only number) and the randomness comes from a generator that
``train_gates`` seeds apart from the evaluation's: no training prompt is one
of ``kvjax.tasks.niah``'s ("repeat" lines or "natural" sentences).

A model without a tokenizer gets token-id passkeys (``token_batch``): random
ids, a run of key ids at a random depth, a marker id, and the key again as
the answer.

Dimension letters: B batch, T tokens.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

INSTRUCTION = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
               "it. I will quiz you about the pass key.")
QUESTION = "What is the pass key? Answer with the number only."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# Filler vocabulary: everyday words, none of them digits.
WORDS = tuple("""
able about above across after again against almost alone along already also always among
animal answer apple area around autumn baby back ball band bank basket beach bean bear beauty
bed bell bird black blanket blue boat body bone book border bottle box branch bread bright
bring brown bucket butter button cake camera candle card care carpet carry castle cat chain
chalk cheese cherry circle city class clean clock cloud coat coffee cold colour corner cotton
country cover cow crowd cup curtain dance dark daughter desk dinner dog door dream dress drink
drum dust early earth east egg engine evening face fact family farm feather fence field finger
fire fish flag floor flower fog forest friend fruit garden gate glass glove gold grain grass
green ground hair hammer hand hat heart hill hole horse house ice island jacket jelly jewel
journey kettle key kitchen kite knee knife ladder lake lamp leaf letter library light lion
lock map market meal milk mirror money moon morning mountain mouse music nail needle nest net
night noise north ocean office orange oven page paint paper parcel park path pencil picture
pillow plant plate pocket pond potato quiet rabbit rain river road rock roof room rope rose
salt sand school sea shadow sheep shelf ship shirt shoe silver sister sky snow soap sock song
soup spoon spring square stair star station stone storm street string summer sun table tail
teacher thread ticket tiger towel tower town toy train tree truck umbrella valley village
wall water wave weather wheel whistle window wing winter wire wood wool yard yellow
""".split())


def _sentence(rng: np.random.Generator) -> str:
  words = [WORDS[i] for i in rng.integers(len(WORDS), size=int(rng.integers(5, 13)))]
  return " ".join(words).capitalize() + "."


def _filler_ids(tokenizer, rng: np.random.Generator, n: int) -> list[int]:
  """At least ``n`` token ids of random-word sentences, cut to n."""
  ids: list[int] = []
  while len(ids) < n:
    text = " ".join(_sentence(rng) for _ in range(max(8, (n - len(ids)) // 8)))
    ids += tokenizer.encode(" " + text)
  return ids[:n]


def passkey_tokens(tokenizer, rng: np.random.Generator, length: int) -> tuple[np.ndarray, int]:
  """One prompt of exactly ``length`` tokens with its answer at the end.

  The parts are tokenized apart and joined (a token may differ from
  tokenizing the whole text at a seam; the model reads it all the same).

  Returns:
    (tokens [T] int32, the number of answer tokens at the end).

  Raises:
    ValueError: ``length`` leaves fewer than 16 filler tokens.
  """
  key = str(int(rng.integers(10000, 100000)))
  marker = "\x00FILLER\x00"
  prompt = tokenizer.chat([{"role": "user", "content": f"{INSTRUCTION}\n{marker}\n{QUESTION}"}])
  head_text, tail_text = prompt.split(marker)
  head = tokenizer.encode(head_text)  # as generation encodes a prompt
  tail = tokenizer.encode(tail_text)
  needle = tokenizer.encode(" " + NEEDLE.format(key=key))
  answer = tokenizer.encode(key)
  n = length - len(head) - len(tail) - len(needle) - len(answer)
  if n < 16:
    raise ValueError(f"length {length} leaves {n} filler tokens around the pass key; it "
                     f"needs at least {length - n + 16}")
  filler = _filler_ids(tokenizer, rng, n)
  cut = int(rng.integers(0, n + 1))
  ids = head + filler[:cut] + needle + filler[cut:] + tail + answer
  return np.asarray(ids, np.int32), len(answer)


def token_batch(rng: np.random.Generator, *, length: int, batch_size: int, vocab_size: int,
                key_tokens: int = 8) -> tuple[np.ndarray, np.ndarray]:
  """Token-id passkeys for a model without a tokenizer.

  Each row: random ids, ``key_tokens`` random ids at a random depth of the
  first half, random ids up to the end less 1 + key_tokens, a marker (id 0),
  the key again.

  Returns:
    (tokens [B, T] int32, answer [B] int32, all ``key_tokens``).
  """
  if length < 4 * key_tokens + 2:
    raise ValueError(f"length {length} is too short for a {key_tokens}-token key")
  tokens = rng.integers(1, vocab_size, size=(batch_size, length)).astype(np.int32)
  for row in tokens:
    key = rng.integers(1, vocab_size, size=key_tokens)
    at = int(rng.integers(1, length // 2 - key_tokens))
    row[at:at + key_tokens] = key
    row[-key_tokens - 1] = 0
    row[-key_tokens:] = key
  return tokens, np.full((batch_size,), key_tokens, np.int32)


def batches(tokenizer, *, length: int, batch_size: int,
            vocab_size: int) -> Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray]]:
  """The default data source of ``train_gates``: rng -> (tokens [B, T] int32, answer [B] int32).

  Passkey prompts from ``tokenizer``; token-id passkeys (``token_batch``)
  where it is None.
  """
  if tokenizer is None:
    return lambda rng: token_batch(rng, length=length, batch_size=batch_size,
                                   vocab_size=vocab_size)
  passkey_tokens(tokenizer, np.random.default_rng(0), length)  # a too short length fails here

  def batch(rng: np.random.Generator):
    rows = [passkey_tokens(tokenizer, rng, length) for _ in range(batch_size)]
    return (np.stack([ids for ids, _ in rows]),
            np.asarray([answer for _, answer in rows], np.int32))

  return batch
