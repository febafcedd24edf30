"""Evaluation metrics against values worked out by hand."""

import pytest

from kvjax.eval import metrics


def test_contains_counts_each_expected_string():
  assert metrics.contains("The pass key is 12345.", ["12345"]) == 1.0
  assert metrics.contains("12345 and 999", ["12345", "54321"]) == 0.5
  assert metrics.contains("nothing", ["12345"]) == 0.0


def test_normalize_answer():
  assert metrics.normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"


def test_qa_f1_by_hand():
  # pred {eiffel, tower, paris} vs ref {paris}: precision 1/3, recall 1 -> F1 = 0.5
  assert metrics.qa_f1("the Eiffel tower, Paris", ["Paris"]) == pytest.approx(0.5)
  # best over answers: "eiffel tower" -> p = 2/3, r = 1 -> 0.8
  assert metrics.qa_f1("the Eiffel tower, Paris", ["Lyon", "Eiffel Tower"]) == pytest.approx(0.8)
  assert metrics.qa_f1("", ["x"]) == 0.0


def test_rouge_l_by_hand():
  # LCS("a b c d", "a c d e") = "a c d" = 3: p = 3/4, r = 3/4 -> 0.75
  assert metrics.rouge_l("a b c d", ["a c d e"]) == pytest.approx(0.75)
  assert metrics.rouge_l("x y", ["a b"]) == 0.0


def test_classification_by_hand():
  classes = ["sports", "politics", "football"]
  assert metrics.classification("It is about sports.", ["sports"], all_classes=classes) == 1.0
  # two labels named, the right one among them -> 1/2
  assert metrics.classification("sports or politics", ["sports"], all_classes=classes) == 0.5
  # "sports" would not rival "football"... but a label inside the answer is not a rival:
  assert metrics.classification("football", ["football"], all_classes=classes + ["foot"]) == 1.0
  assert metrics.classification("politics", ["sports"], all_classes=classes) == 0.0
  with pytest.raises(ValueError, match="all_classes"):
    metrics.classification("sports", ["sports"])


def test_retrieval_by_hand():
  assert metrics.retrieval("Paragraph 3", ["Paragraph 3"]) == 1.0
  assert metrics.retrieval("Paragraph 3 or 5", ["Paragraph 3"]) == 0.5
  assert metrics.retrieval("no idea", ["Paragraph 3"]) == 0.0


def test_code_sim_by_hand():
  # the first line without a comment mark is compared: "x = 1" vs "x = 2": LCS 4 of 5 + 5
  assert metrics.code_sim("# set x\nx = 1\n", ["x = 2"]) == pytest.approx(0.8)
  assert metrics.edit_similarity("abc", "abc") == 1.0
  assert metrics.edit_similarity("", "") == 1.0
  assert metrics.edit_similarity("ab", "cd") == 0.0


def test_score_and_correct():
  assert metrics.score("contains", "key 1 2", ["1", "2"]) == (1.0, True)
  assert metrics.score("contains", "key 1", ["1", "2"]) == (0.5, False)
  assert metrics.score("qa_f1", "Paris", ["Paris"]) == (1.0, True)
  with pytest.raises(ValueError, match="unknown metric"):
    metrics.score("bleu", "a", ["a"])
  with pytest.raises(ValueError, match="at least one"):
    metrics.score("contains", "a", [])
