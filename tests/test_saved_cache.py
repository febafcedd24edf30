"""Compress once, answer many: a compressed cache saved, loaded and questioned.

The answers from a loaded cache are the tokens of ``generate`` in
query-agnostic mode with the question appended, for every policy; the round
trip keeps every array and field; bad folders fail with a ValueError that
names them.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import jax
import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax import testing
from kvjax.cache import checkpoint
from kvjax.generation import programs

CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512, tie_embeddings=False,
    rope_theta=500.0, name="tiny")
DELIMITERS = (5, 6, 7)
BUDGET = 96  # entries per head: above every policy's sinks and windows, below the document
NEW = 6  # max_new_tokens
ROOM = 64 + NEW  # a question (padded to 64 tokens) and its answer


@pytest.fixture(scope="module")
def lm():
  return kvjax.init_random(CONFIG, seed=3)


@pytest.fixture(scope="module")
def document():
  rng = np.random.default_rng(0)
  ids = rng.integers(len(DELIMITERS) + 5, CONFIG.vocab_size, 181)
  ids[rng.random(len(ids)) < 0.08] = DELIMITERS[0]
  return ids.tolist()


QUESTIONS = ([11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43])


def _policy(name: str, folder: pathlib.Path):
  return testing.policy_for(name, CONFIG, folder, DELIMITERS)


def _budget(name: str) -> int | None:
  return None if name == "full" else BUDGET


@pytest.mark.parametrize("name", policies.names())
def test_answers_from_a_loaded_cache_are_generates(lm, document, name, tmp_path):
  policy, budget = _policy(name, tmp_path), _budget(name)
  context = kvjax.compress(lm, [document], policy=policy, budget=budget, room=ROOM)
  path = kvjax.save_cache(tmp_path / "doc", context)
  del context
  loaded = kvjax.load_cache(path, lm)
  answers = kvjax.answer(lm, loaded, list(QUESTIONS), max_new_tokens=NEW, stop_ids=[])
  assert len(answers) == len(QUESTIONS)
  for question, got in zip(QUESTIONS, answers):
    want = kvjax.generate(lm, [document], questions=[question], query_aware=False,
                          policy=policy, budget=budget, max_new_tokens=NEW, stop_ids=[])
    assert got.token_ids == want.token_ids, name
    assert got.stats.prompt_tokens == want.stats.prompt_tokens
    assert got.cache.capacity == want.cache.capacity
    np.testing.assert_array_equal(got.cache.kept_positions(), want.cache.kept_positions(),
                                  err_msg=name)
  # The loaded context is left as it was: each question had a copy.
  np.testing.assert_array_equal(loaded.cache.lengths, kvjax.load_cache(path).cache.lengths)


def test_ragged_documents_answer_together_without_a_prefill(lm, document, tmp_path,
                                                            monkeypatch):
  documents = [document, document[40:150]]
  kw = dict(policy="snapkv", budget=BUDGET)
  context = kvjax.load_cache(kvjax.save_cache(tmp_path / "docs", kvjax.compress(
      lm, documents, **kw)), lm)
  assert context.lengths.tolist() == [181, 110]

  def prefilled(*args, **kwargs):
    raise AssertionError("answer ran a prefill program")

  with monkeypatch.context() as patch:
    for name in ("prefill", "record", "store", "prefill_chunk"):
      patch.setattr(programs, name, prefilled)
    got, = kvjax.answer(lm, context, QUESTIONS[0], max_new_tokens=NEW, stop_ids=[])
  want = kvjax.generate(lm, documents, questions=[QUESTIONS[0]] * 2, query_aware=False,
                        max_new_tokens=NEW, stop_ids=[], **kw)
  assert got.token_ids == want.token_ids


def test_round_trip_keeps_every_array_and_field(lm, document, tmp_path):
  policy = policies.get("adakv", inner=policies.get("sablock", delimiter_ids=DELIMITERS))
  context = kvjax.compress(lm, [document], policy=policy, budget=BUDGET, room=ROOM,
                           page_size=8)
  path = kvjax.save_cache(tmp_path / "doc", context)
  loaded = kvjax.load_cache(path, lm)
  assert jax.tree.structure(loaded.cache) == jax.tree.structure(context.cache)
  for name in checkpoint.ARRAYS:
    saved, back = np.asarray(getattr(context.cache, name)), np.asarray(getattr(loaded.cache, name))
    assert saved.dtype == back.dtype, name
    np.testing.assert_array_equal(back, saved, err_msg=name)
  assert (loaded.cache.page_size, loaded.cache.capacity, loaded.cache.shards) == \
      (8, context.cache.capacity, (1, 1))
  for field in dataclasses.fields(kvjax.CompressedContext):
    if field.name != "cache":
      np.testing.assert_equal(getattr(loaded, field.name), getattr(context, field.name),
                              err_msg=field.name)
  assert loaded.policy == context.policy and loaded.policy.inner.delimiter_ids == DELIMITERS
  extra = checkpoint.read_metadata(path)["extra"]
  assert extra["kvjax_version"] == kvjax.__version__
  assert (extra["model"]["name"], extra["budget"], extra["page_size"], extra["dtype"]) == \
      ("tiny", BUDGET, 8, "float32")


@pytest.mark.parametrize("name", ["snapkv", "adakv", "full"])
def test_the_compressed_pool_holds_what_was_kept_alone(lm, document, name):
  context = kvjax.compress(lm, [document], policy=name, budget=_budget(name), room=ROOM)
  lengths = np.asarray(context.cache.lengths)[0]  # [L, K]
  np.testing.assert_array_equal(np.asarray(context.cache.capacity), -(-lengths // 16) * 16)
  assert int(context.cache.num_free) == 0
  if name != "adakv":  # (AdaKV splits a layer's pages unevenly among its heads)
    np.testing.assert_array_equal(lengths, BUDGET if name == "snapkv" else len(document))


@pytest.fixture(scope="module")
def saved(lm, document, tmp_path_factory):
  """A compressed context saved once; tests copy it before damaging it."""
  path = tmp_path_factory.mktemp("saved") / "doc"
  return kvjax.save_cache(path, kvjax.compress(lm, [document], policy="snapkv", budget=BUDGET))


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  import shutil
  shutil.copytree(src, dst)
  return dst


def _data_files(path: pathlib.Path) -> list[pathlib.Path]:
  files = sorted((path / "cache").rglob("d/*"), key=lambda f: -f.stat().st_size)
  assert files, sorted(path.rglob("*"))
  return files


def test_missing_folder(tmp_path):
  with pytest.raises(ValueError, match=f"no saved KV cache at {tmp_path / 'nothing'}: it does "
                                       "not exist"):
    kvjax.load_cache(tmp_path / "nothing")


def test_a_deleted_file_is_a_truncated_checkpoint(saved, tmp_path):
  path = _copy(saved, tmp_path / "cut")
  _data_files(path)[0].unlink()
  with pytest.raises(ValueError, match=rf"{path} is not a complete saved KV cache \(truncated "
                                       r"or corrupt\)"):
    kvjax.load_cache(path)


def test_a_deleted_item_is_a_truncated_checkpoint(saved, tmp_path):
  path = _copy(saved, tmp_path / "cut")
  import shutil
  shutil.rmtree(path / "metadata")
  with pytest.raises(ValueError, match=rf"{path} is not a complete saved KV cache.*metadata "
                                       "item is missing"):
    kvjax.load_cache(path)


def test_damaged_bytes_are_a_corrupt_checkpoint(saved, tmp_path):
  path = _copy(saved, tmp_path / "damaged")
  data = _data_files(path)[0]
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  data.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=rf"{path} is not a complete saved KV cache \(truncated "
                                       r"or corrupt\)"):
    kvjax.load_cache(path)


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=3), "num_layers 2 \\(model 3\\)"),
    (dict(name="other"), "name 'tiny' \\(model 'other'\\)"),
    (dict(rope_theta=10000.0), "rope_theta 500.0 \\(model 10000.0\\)"),
])
def test_a_cache_of_another_model(saved, document, change, message):
  other = kvjax.init_random(dataclasses.replace(CONFIG, **change), seed=3)
  with pytest.raises(ValueError, match=rf"{saved} holds a cache of model 'tiny'.*{message}"):
    kvjax.load_cache(saved, other)
  context = kvjax.load_cache(saved)
  with pytest.raises(ValueError, match=f"the context holds a cache of model 'tiny'.*{message}"):
    kvjax.answer(other, context, QUESTIONS[0], max_new_tokens=2)


def test_folders_that_are_not_kvjax_caches(lm, saved, tmp_path):
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "a.txt").write_text("hello")
  with pytest.raises(ValueError, match=f"{tmp_path / 'notes'} is not a saved KV cache: it "
                                       "holds no 'cache' and 'metadata' items"):
    kvjax.load_cache(tmp_path / "notes")
  with pytest.raises(ValueError, match=f"{tmp_path / 'notes' / 'a.txt'} is a file"):
    kvjax.load_cache(tmp_path / "notes" / "a.txt")
  from kvjax.retrieval_heads import save_gates
  gates = save_gates(tmp_path / "gates", np.ones((2, 2), np.float32), model="tiny", n_sink=4,
                     recent=60, steps=1, losses=[0.0])
  with pytest.raises(ValueError, match=f"{gates} is not a saved KV cache: its metadata is not "
                                       "kvjax's"):
    kvjax.load_cache(gates)
  bare = checkpoint.save(tmp_path / "bare", kvjax.load_cache(saved).cache)
  with pytest.raises(ValueError, match=f"{bare} is a saved KV cache but not a compressed "
                                       "context"):
    kvjax.load_cache(bare)
  np.testing.assert_array_equal(checkpoint.load(bare)[0].k_pages,
                                kvjax.load_cache(saved).cache.k_pages)


def test_saving_never_replaces_what_it_did_not_write(lm, saved, tmp_path):
  context = kvjax.load_cache(saved, lm)
  with pytest.raises(ValueError, match=f"{saved} already exists; pass overwrite=True"):
    kvjax.save_cache(saved, context)
  assert kvjax.save_cache(saved, context, overwrite=True) == saved
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "thesis.tex").write_text("...")
  with pytest.raises(ValueError, match="is not a saved KV cache: not replacing it"):
    kvjax.save_cache(tmp_path / "mine", context, overwrite=True)
  assert (tmp_path / "mine" / "thesis.tex").read_text() == "..."


def test_an_overwrite_that_fails_leaves_the_old_cache(lm, saved, tmp_path, monkeypatch):
  """The new cache is written beside the old one and renamed over it once whole: a
  write that fails part way (a full disk, here a writer that stops) destroys nothing."""
  copy = tmp_path / "copy"
  context = kvjax.load_cache(saved, lm)
  kvjax.save_cache(copy, context)
  before = kvjax.load_cache(copy, lm).cache.k_pages
  ocp, writer = checkpoint.checkpointer()

  class FullDisk:
    def __getattr__(self, name):  # reading, as orbax's
      return getattr(writer, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def save(self, folder, **kwargs):
      writer.save(folder, **kwargs)  # orbax's force=True replaces the folder, then the
      shutil.rmtree(folder / "metadata")  # disk fills before the last item is written
      raise OSError(28, "No space left on device")

  monkeypatch.setattr(checkpoint, "checkpointer", lambda: (ocp, FullDisk()))
  with pytest.raises(OSError, match="No space left"):
    kvjax.save_cache(copy, context, overwrite=True)
  monkeypatch.undo()
  np.testing.assert_array_equal(kvjax.load_cache(copy, lm).cache.k_pages, before)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # nothing left beside it
  assert kvjax.save_cache(copy, context, overwrite=True) == copy
  assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_a_whole_page_policy_refuses_more_than_its_room(lm, document):
  context = kvjax.compress(lm, [document], policy="adakv", budget=BUDGET, room=ROOM)
  with pytest.raises(ValueError, match=f"need {64 + NEW + 1}: compress with a larger room"):
    kvjax.answer(lm, context, QUESTIONS[0], max_new_tokens=NEW + 1)


@pytest.mark.slow
def test_a_chat_turn_is_answered_as_generate_answers_it(smollm2_lm, tmp_path):
  doc = kvjax.tasks.example_document()
  kw = dict(policy="snapkv", budget=256)
  context = kvjax.compress(smollm2_lm, doc.text, chat_template=True, **kw)
  loaded = kvjax.load_cache(kvjax.save_cache(tmp_path / "doc", context), smollm2_lm)
  assert loaded.chat_template
  got, = kvjax.answer(smollm2_lm, loaded, doc.question, max_new_tokens=16)
  want = kvjax.generate(smollm2_lm, [doc.text], questions=[doc.question], chat_template=True,
                        query_aware=False, max_new_tokens=16, **kw)
  assert got.token_ids == want.token_ids
  assert got.texts == want.texts
