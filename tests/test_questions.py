"""The question path with chat models: one user turn, cut where the question starts.

``generate(lm, [context], questions=[question], chat_template=True)`` asks that
question about that context. Query-aware runs compress the whole turn (the
question inside the observation window); query-agnostic ones compress the
context alone and append the question, the turn's end and the assistant's
header uncompressed.
"""

import numpy as np
import pytest

import kvjax
from kvjax.eval import retention
from kvjax.generation import inputs

DOC = kvjax.tasks.example_document()
# SnapKV keeps the code in most heads from here on in both modes; its window
# (64) then watches the context's last tokens in query-agnostic runs, so the
# budget must hold the fact without the question's help.
BUDGET = 1152


def test_turn_is_cut_before_the_question(smollm2_lm):
  tok = smollm2_lm.tokenizer
  (context,), (question,) = inputs._chat_turns(smollm2_lm, ["Some text."], ["Which text?"])
  whole = tok.apply_chat_template([{"role": "user", "content": "Some text.\nWhich text?"}])
  assert context + question == whole
  assert context.endswith("Some text.")
  assert question.startswith("\nWhich text?<|im_end|>")
  assert question.endswith("<|im_start|>assistant\n")


def test_without_questions_each_prompt_is_a_turn(smollm2_lm):
  (context,), questions = inputs._chat_turns(smollm2_lm, ["Hi."], None)
  assert questions is None
  assert context == smollm2_lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}])


@pytest.mark.parametrize("prompts, questions, message", [
    ([[1, 2, 3]], None, "chat_template=True takes string prompts and questions; prompt 0 is list"),
    (["a"], [[5, 6]], "question 0 is list"),
])
def test_chat_template_needs_text(smollm2_lm, prompts, questions, message):
  with pytest.raises(ValueError, match=message):
    kvjax.generate(smollm2_lm, prompts, questions=questions, chat_template=True,
                   max_new_tokens=2)


@pytest.mark.parametrize("query_aware", [True, False], ids=["query-aware", "query-agnostic"])
def test_question_about_a_document_is_answered(smollm2_lm, query_aware):
  runs = [("full", None), ("snapkv", BUDGET)]
  results = list(kvjax.generate_each(
      smollm2_lm, [DOC.text], runs, questions=[DOC.question], chat_template=True,
      query_aware=query_aware, max_new_tokens=16))
  contexts, _ = inputs._chat_turns(smollm2_lm, [DOC.text], [DOC.question])
  span = retention.answer_span(smollm2_lm.tokenizer, contexts[0], DOC.answer)
  for result in results:
    assert DOC.answer in result.texts[0], (result.stats.policy, result.texts[0])
  full, snapkv = results
  assert full.stats.prompt_tokens == snapkv.stats.prompt_tokens
  kept = np.asarray(snapkv.cache.kept_positions())[0]
  # Every head holds the budget, plus (query-agnostic) the question and the generated tokens.
  assert (kept >= 0).sum(-1).max() < full.stats.prompt_tokens[0] - 200
  held, whole = retention.retention(kept, span)
  assert held < 1.0  # compressed: some heads dropped part of the code ...
  assert whole > 0.5  # ... and most kept all of it
