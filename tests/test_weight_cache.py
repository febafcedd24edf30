"""kvjax.load(weight_cache=...): a second load restores what the first converted."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax.models import gguf_loader
from kvjax.models import weight_cache


def test_second_load_restores_without_converting(smollm2_path, tmp_path, monkeypatch):
  first = kvjax.load(smollm2_path, weight_cache=tmp_path)
  (entry,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
  assert (entry / "complete").is_file()

  def no_conversion(*args, **kwargs):
    raise AssertionError("the cached load converted the GGUF again")

  monkeypatch.setattr(gguf_loader, "load_gguf", no_conversion)
  second = kvjax.load(smollm2_path, weight_cache=tmp_path)
  assert second.config == first.config and second.source == first.source
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = "<|im_start|>user\nThe capital of France is"
  assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
  assert second.tokenizer.stop_ids == first.tokenizer.stop_ids
  kwargs = dict(max_new_tokens=6, policy="snapkv", budget=128)
  assert (kvjax.generate(second, [text * 20], **kwargs).token_ids
          == kvjax.generate(first, [text * 20], **kwargs).token_ids)


def test_other_options_are_other_entries_and_partial_saves_are_ignored(smollm2_path, tmp_path):
  a = weight_cache.entry(tmp_path, smollm2_path, dtype=np.float32, scan_layers=True,
                         packed=False)
  b = weight_cache.entry(tmp_path, smollm2_path, dtype=np.float32, scan_layers=True,
                         packed=True)
  assert a != b
  a.mkdir(parents=True)  # an interrupted save: no "complete" marker
  assert weight_cache.restore(a, np.float32) is None
  assert weight_cache.root(None) is None and weight_cache.root(False) is None


def test_off_by_default_writes_nothing(smollm2_path, tmp_path, monkeypatch):
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
  kvjax.load(smollm2_path)
  assert not (tmp_path / "weights").exists()


def test_a_file_where_the_folder_would_be_is_a_value_error(smollm2_path, tmp_path, monkeypatch):
  (tmp_path / "taken").write_text("not a folder")
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "taken"))
  with pytest.raises(ValueError, match=r"weights \(\$KVJAX_CACHE_DIR\) cannot be made: .*taken "
                                       "is a file"):
    kvjax.load(smollm2_path, weight_cache=True)
  with pytest.raises(ValueError, match="cannot be made: .*taken is a file"):
    kvjax.load(smollm2_path, weight_cache=tmp_path / "taken" / "w")
