"""A document to try kvjax on: prose with one fact in it, and a question about the fact.

``kvjax.tasks.example_document()`` is about 1,450 tokens (SmolLM2's tokenizer)
of plain prose about a harbour town, written for kvjax, with a five-digit code
stated once, a little past the middle. It is what the README's examples ask
about: long enough that compression matters, short enough to run in seconds on
a CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.resources


@dataclasses.dataclass(frozen=True)
class Document:
  """A text, a question about it, and the answer the text gives."""

  text: str
  question: str
  answer: str


def example_document() -> Document:
  """The harbour-town document; its answer is in the text word for word."""
  text = importlib.resources.files("kvjax.tasks").joinpath("harbour_town.txt").read_text(
      encoding="utf-8")
  return Document(text=text.strip(), question="What is the code to the lamp room's lock?",
                  answer="58213")
