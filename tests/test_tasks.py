"""Task generators: the requested length in tokens, the needle at the requested depth."""

import json

import pytest

from kvjax import tasks
from kvjax.tasks import dataset as dataset_lib
from kvjax.tasks import haystack as haystack_lib


@pytest.fixture(scope="module")
def tok(smollm2_lm):
  return smollm2_lm.tokenizer


@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("kind", haystack_lib.KINDS)
@pytest.mark.parametrize("length", [700, 2048])
def test_length_in_tokens(tok, task, kind, length):
  s = tasks.make_sample(tok, task, length=length, depth=0.4, haystack=kind, seed=3)
  assert length - 3 <= s.num_tokens <= length
  assert len(tok.encode(s.prompt)) == s.num_tokens
  assert s.prompt.endswith("<|im_start|>assistant\n")
  assert all(a in s.context for a in s.answers)  # the answers are in the context,
  assert not any(a in s.question for a in s.answers)  # not in the question


@pytest.mark.parametrize("kind", haystack_lib.KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_depth(tok, kind, depth):
  s = tasks.make_sample(tok, "niah", length=2048, depth=depth, haystack=kind, seed=1)
  key = s.answer
  body = s.context.split("\n", 2)[2]  # after "<|im_start|>user" and the instruction line
  needle_start = body.index(next(p for p in ("The pass key is", "The special magic number")
                                 if p in body))
  before = len(tok.encode(body[:needle_start]))
  total = len(tok.encode(body))
  assert key in body[needle_start:needle_start + 60]
  assert abs(before / total - depth) <= 0.03, (before, total)


def test_filler_kinds_differ(tok):
  natural = haystack_lib.filler_units("natural", 50, seed=0)
  assert len(set(natural)) >= 45  # varied sentences
  assert not any(c.isdigit() for c in " ".join(natural))  # no number to mistake for a needle
  assert len(set(haystack_lib.filler_units("repeat", 50, seed=0))) == 5
  with pytest.raises(ValueError, match="haystack kind"):
    haystack_lib.filler_units("poetry", 3, seed=0)


def test_deterministic_for_a_seed(tok):
  a = tasks.make_sample(tok, "niah_multikey", length=800, haystack="natural", seed=5, index=2)
  b = tasks.make_sample(tok, "niah_multikey", length=800, haystack="natural", seed=5, index=2)
  c = tasks.make_sample(tok, "niah_multikey", length=800, haystack="natural", seed=5, index=3)
  assert a == b and a.prompt != c.prompt


def test_multi_needle_tasks(tok):
  mk = tasks.make_sample(tok, "niah_multikey", length=1500, seed=0)
  assert mk.context.count("The special magic number for") == 4 and len(mk.answers) == 1
  mv = tasks.make_sample(tok, "niah_multivalue", length=1500, seed=0)
  assert len(mv.answers) == 4 and all(a in mv.context for a in mv.answers)
  vt = tasks.make_sample(tok, "variable_tracking", length=1500, seed=0)
  first, *rest = vt.answers
  assert f"VAR {first} = " in vt.context
  for prev, name in zip(vt.answers, rest):  # each copy comes after what it copies
    assert vt.context.index(f"VAR {name} = VAR {prev}.") > vt.context.index(f"VAR {prev} =")


def test_too_short_a_length_is_refused(tok):
  with pytest.raises(ValueError, match="below the"):
    tasks.make_sample(tok, "niah", length=20)
  with pytest.raises(ValueError, match="task must be"):
    tasks.make_sample(tok, "haiku", length=500)


def test_reads_a_kvpress_schema_jsonl(tok, tmp_path):
  rows = [
      {"context": "Alice lives in Paris. " * 20, "question": "Where does Alice live?",
       "answer": "Paris", "answer_prefix": "Answer: ", "max_new_tokens": 5, "id": "q1"},
      {"context": "The code is 42.", "question": "What is the code?", "answer": ["42", "forty-two"]},
  ]
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  samples = dataset_lib.dataset_samples(tok, path, metric="qa_f1")
  assert [s.id for s in samples] == ["q1", "1"]
  assert samples[0].answers == ("Paris",) and samples[1].answers == ("42", "forty-two")
  assert samples[0].max_new_tokens == 5 and samples[1].max_new_tokens == 32
  assert samples[0].question.endswith("<|im_start|>assistant\nAnswer: ")
  assert samples[0].context.startswith("<|im_start|>user\nAlice lives in Paris.")
  assert "Where does Alice live?" in samples[0].question
  # Too long a context loses its middle until the prompt fits.
  short = dataset_lib.dataset_samples(tok, path, max_tokens=60)
  assert short[0].num_tokens <= 60 and short[0].context.count("Alice") < 20


def test_reads_parquet(tok, tmp_path):
  import pyarrow as pa  # the test extra installs it (parquet is optional for users)
  import pyarrow.parquet as pq
  path = tmp_path / "data.parquet"
  pq.write_table(pa.table({"context": ["It rains."], "question": ["Weather?"],
                           "answer": [["rain"]]}), path)
  (s,) = dataset_lib.dataset_samples(tok, path)
  assert s.answers == ("rain",)


@pytest.mark.parametrize("content, message", [
    ("", "has no rows"),
    ("{not json}\n", "not a JSON line"),
    ('{"context": "x", "question": "y"}\n', "lacks \\['answer'\\]"),
    ('[1, 2]\n', "not an object"),
])
def test_bad_datasets_are_refused(tmp_path, content, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(content)
  with pytest.raises(dataset_lib.DatasetError, match=message):
    dataset_lib.read_rows(path)


@pytest.mark.parametrize("task", tasks.niah.TASKS)
def test_a_base_model_gets_the_answer_s_lead_in(tok, task):
  # SmolLM2-Instruct ships a chat template: no lead-in unless asked for.
  assert tok.has_chat_template
  plain = tasks.niah.make_sample(tok, task, length=600, haystack="natural", seed=3)
  led = tasks.niah.make_sample(tok, task, length=600, haystack="natural", seed=3, lead_in=True)
  assert plain.question.endswith("<|im_start|>assistant\n")
  assert led.question.startswith(plain.question) and led.question.endswith(" ")
  assert led.question[len(plain.question):].startswith("The ")
  assert led.num_tokens <= 600 and led.context != plain.context  # refitted around the lead-in
