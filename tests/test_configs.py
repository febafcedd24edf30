"""configs/: every file builds its config; the default model's matches its GGUF."""

import importlib.util
import pathlib

import pytest

import kvjax

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.py"))


def _get_config(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_a_model_shape(path):
  config = _get_config(path)
  assert isinstance(config, kvjax.LlamaConfig)
  assert config.num_heads % config.num_kv_heads == 0


def test_smollm2_config_equals_the_gguf(smollm2_lm):
  assert _get_config(CONFIGS[[p.stem for p in CONFIGS].index("smollm2_135m")]) == \
      smollm2_lm.config
