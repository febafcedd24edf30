"""A SentencePiece model (``tokenizer.model``) behind kvjax's Tokenizer.

Llama 2, Mistral and Gemma checkpoints ship a SentencePiece model, some
without a ``tokenizer.json``. ``SentencePieceBackend`` reads it with the
``sentencepiece`` library and answers the calls ``kvjax.models.tokenizer``
makes of a ``tokenizers.Tokenizer``, so the rest of kvjax sees one interface.

Text is encoded as transformers' SentencePiece tokenizers do: control tokens
written in the text (``<s>``, ``</s>``, ...) map to their ids, and each stretch
of text between them is SentencePiece's own encoding (its dummy "▁" prefix
included). User-defined symbols (Gemma's ``<start_of_turn>``) are
SentencePiece's to match.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

@dataclasses.dataclass(frozen=True)
class _Added:
  """What ``tokenizers.Tokenizer.get_added_tokens_decoder`` gives per token."""

  content: str
  special: bool


@dataclasses.dataclass(frozen=True)
class _Encoding:
  ids: list[int]


class SentencePieceBackend:
  """The subset of ``tokenizers.Tokenizer`` that kvjax's Tokenizer uses, over SentencePiece."""

  def __init__(self, path: str | os.PathLike):
    import sentencepiece  # only for checkpoints that ship a tokenizer.model

    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(str(path))
    except (OSError, RuntimeError) as e:
      raise ValueError(f"{path}: not a readable SentencePiece model: {e}") from None
    n = self._sp.GetPieceSize()
    # Control pieces (<s>, </s>, <pad>) and the unknown piece: matched whole in text,
    # dropped when decoding with skip_special_tokens.
    self._control = {i: self._sp.IdToPiece(i) for i in range(n)
                     if self._sp.IsControl(i) or self._sp.IsUnknown(i)}
    ordered = sorted(self._control.values(), key=len, reverse=True)  # longest match first
    self._split = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None

  @property
  def processor(self):
    """The ``sentencepiece.SentencePieceProcessor``."""
    return self._sp

  def special_ids(self) -> dict[str, int | None]:
    """The model's own bos, eos and pad ids (None where it has none)."""
    ids = dict(bos=self._sp.bos_id(), eos=self._sp.eos_id(), pad=self._sp.pad_id())
    return {k: (v if v >= 0 else None) for k, v in ids.items()}

  def get_added_tokens_decoder(self) -> dict[int, _Added]:
    return {i: _Added(piece, special=True) for i, piece in self._control.items()}

  def get_vocab_size(self, with_added_tokens: bool = True) -> int:
    del with_added_tokens  # SentencePiece's pieces include its control symbols
    return self._sp.GetPieceSize()

  def token_to_id(self, token: str) -> int | None:
    i = self._sp.PieceToId(token)
    # PieceToId answers unk for any unknown piece.
    return i if i != self._sp.unk_id() or token == self._sp.IdToPiece(i) else None

  def id_to_token(self, token_id: int) -> str | None:
    return self._sp.IdToPiece(token_id) if 0 <= token_id < self._sp.GetPieceSize() else None

  def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
    del add_special_tokens  # BOS is kvjax's Tokenizer's to add
    parts = self._split.split(text) if self._split else [text]
    ids = []
    for part in filter(None, parts):
      is_control = self._split is not None and self._split.fullmatch(part)
      ids += [self._sp.PieceToId(part)] if is_control else self._sp.EncodeAsIds(part)
    return _Encoding(ids)

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                   ) -> list[_Encoding]:
    return [self.encode(t, add_special_tokens) for t in texts]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    pieces, text = [], []
    for i in ids:
      if i in self._control:
        if not skip_special_tokens:
          text.append(self._sp.DecodeIds(pieces))
          text.append(self._control[i])
          pieces = []
        continue
      pieces.append(int(i))
    text.append(self._sp.DecodeIds(pieces))
    return "".join(text)
