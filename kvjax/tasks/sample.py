"""A prompt with known answers, split where query-agnostic compression cuts it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sample:
  """One evaluation prompt.

  ``context + question`` is the whole prompt, chat markup included. The split
  is where query-agnostic evaluation compresses: ``context`` (instruction and
  haystack) is compressed before ``question`` (the question, the end of the
  user turn, the assistant's start and any answer prefix) is seen.
  """

  context: str
  question: str
  answers: tuple[str, ...]  # expected strings (all must appear for a NIAH hit)
  num_tokens: int  # tokens of the whole prompt
  target_tokens: int | None = None  # the length asked for (synthetic tasks)
  depth: float | None = None  # needle position, fraction of the haystack (None: n/a)
  task: str = ""
  haystack: str = ""  # "repeat", "natural" or "" (datasets)
  id: str = ""
  max_new_tokens: int = 16
  metric: str = "contains"  # kvjax.eval.metrics name
  all_classes: tuple[str, ...] = ()  # candidate labels (classification datasets)

  @property
  def prompt(self) -> str:
    return self.context + self.question

  @property
  def answer(self) -> str:
    """The first expected answer (one-answer tasks have only this one)."""
    return self.answers[0]


def chat_sample(tokenizer, instruction: str, text: str, question: str, *,
                answer_prefix: str = "", **fields) -> Sample:
  """A system-less user turn ``instruction / text / question`` (``Tokenizer.chat``), split at the question.

  The whole prompt's token count goes in ``num_tokens``. Tokenizing the two
  parts separately can differ from the whole by a token at the cut; generation
  tokenizes them separately, as a query-agnostic pipeline must.
  """
  if tokenizer is None:
    raise ValueError("this model has no tokenizer, and task and dataset prompts are text; "
                     "load a model with one (a GGUF, or a folder with tokenizer.json)")
  head = f"{instruction}\n" if instruction else ""
  prompt = tokenizer.chat([{"role": "user", "content": f"{head}{text}\n{question}"}])
  prompt += answer_prefix
  cut = prompt.rindex(f"\n{question}")
  return Sample(context=prompt[:cut], question=prompt[cut:],
                num_tokens=len(tokenizer.encode(prompt)), **fields)
