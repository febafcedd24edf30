"""kvjax.eval.retention: the answer's token span and what a cache keeps of it."""

import numpy as np

from kvjax.eval import retention


def test_answer_span_covers_exactly_the_answer(smollm2_lm):
  tok = smollm2_lm.tokenizer
  context = "Filler words here. The pass key is 36432. Remember it. More filler."
  span = retention.answer_span(tok, context, "36432")
  ids = tok.encode(context)
  # The span's tokens spell the answer (a leading space at most), and are contiguous.
  assert tok.decode([ids[i] for i in span]).strip() == "36432"
  np.testing.assert_array_equal(span, np.arange(span[0], span[-1] + 1))
  assert tok.decode(ids[:span[0]]).rstrip().endswith("key is")


def test_retention_by_hand():
  span = np.array([10, 11, 12])
  kept = np.full((2, 2, 4), -1)
  kept[0, 0, :3] = [10, 11, 12]  # whole
  kept[0, 1, :2] = [10, 40]  # one of three
  kept[1, 0, :4] = [12, 11, 5, 10]  # whole, out of order
  # kept[1, 1] holds nothing
  mean_kept, whole = retention.retention(kept, span)
  np.testing.assert_allclose(mean_kept, (1 + 1 / 3 + 1 + 0) / 4)
  assert whole == 0.5
