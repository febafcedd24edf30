"""Delimiter tokens from the tokenizer's text: where sentences, clauses and code lines end.

Rules look at each token's decoded text, not at fixed ids, so the same rule
works for any tokenizer (byte-level BPE merges punctuation with spaces and
newlines into many ids: ",", ".\\n", " ;", ...).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Text that ends a sentence: . ! ? newline, CJK 。！？
SENTENCE_END = (".", "!", "?", "\n", "。", "！", "？")
# ... or a clause: ASCII , ; : and CJK ， ； ： 、
CLAUSE_END = SENTENCE_END + (",", ";", ":", "，", "；", "：", "、")
# Code delimiters: { } ; ) ]
CODE_DELIMITERS = ("{", "}", ";", ")", "]")


@functools.lru_cache(maxsize=8)
def _ids(tokenizer, chars: tuple[str, ...], anywhere: bool) -> tuple[int, ...]:
  ids = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode([i], skip_special_tokens=True)
    if anywhere:
      if any(c in text for c in chars):
        ids.append(i)
    else:
      text = text.rstrip(" ")
      if text and text[-1] in chars:
        ids.append(i)
  return tuple(ids)


def delimiter_ids(tokenizer, chars: tuple[str, ...] = SENTENCE_END, *,
                  anywhere: bool = False) -> tuple[int, ...]:
  """Ids of the tokens whose decoded text ends with (``anywhere``: contains) one of ``chars``.

  Trailing spaces are ignored by the "ends with" rule. The default is the
  sentence ends; cached per (tokenizer, chars, rule).
  """
  return _ids(tokenizer, tuple(chars), anywhere)


def is_delimiter(tokens: jax.Array, ids: tuple[int, ...]) -> jax.Array:
  """bool [B, T]: the token is one of ``ids``."""
  return jnp.isin(tokens, jnp.asarray(ids, jnp.int32))
