"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) checkpoints against transformers.

Each test builds a small random model with transformers, saves it as a
safetensors folder, loads the folder with kvjax, and compares logits and
greedy tokens.
"""

import numpy as np
import pytest

import kvjax

SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
             rms_norm_eps=1e-6)


def _checkpoint(kind: str, folder, **extra):
  import torch
  import transformers
  config_class, model_class = {
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
  }[kind]
  torch.manual_seed(0)
  config = config_class(**SIZES, **extra)
  model = model_class(config).eval()
  with torch.no_grad():  # larger than the init's 0.02 so that every part shows in the logits
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(folder)
  return model


@pytest.mark.parametrize("kind, extra, flags", [
    ("qwen2", dict(tie_word_embeddings=True), dict(attention_bias=True, qk_norm=False)),
    ("qwen3", dict(head_dim=32, tie_word_embeddings=False),
     dict(attention_bias=False, qk_norm=True)),
    ("qwen3", dict(head_dim=16), dict(attention_bias=False, qk_norm=True)),
])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind, extra, flags):
  import torch
  model = _checkpoint(kind, tmp_path, **extra)
  lm = kvjax.load(tmp_path)
  assert {k: getattr(lm.config, k) for k in flags} == flags
  ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(lm.forward(ids)), want, rtol=2e-4, atol=2e-4)
  # Greedy decoding through the paged cache, against transformers' generate.
  prompt = ids[:1].tolist()
  with torch.no_grad():
    hf = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
  ours = kvjax.generate(lm, prompt, max_new_tokens=8, stop_ids=[]).token_ids[0]
  assert ours == hf


@pytest.mark.parametrize("kind, extra, message", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding-window attention"),
    # Qwen3's attention_bias biases the output projection too, which the model lacks.
    ("qwen3", dict(attention_bias=True), "biases are not supported for qwen3"),
])
def test_unsupported_qwen_variants_are_refused(tmp_path, kind, extra, message):
  _checkpoint(kind, tmp_path, **extra)
  with pytest.raises(ValueError, match=message):
    kvjax.load(tmp_path)
