"""A Llama 3-style checkpoint (llama3-scaled RoPE, untied head) read from safetensors
and run by kvjax gives transformers' logits, with and without the cache."""

import numpy as np
import torch
import transformers

import kvjax


def test_llama3_rope_safetensors_forward_matches_transformers(tmp_path):
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
      max_position_embeddings=16384, tie_word_embeddings=False, rope_theta=500000.0,
      # With head_dim 8 the four wavelengths (6, 167, 4443, 118k tokens) fall in the
      # kept, kept, interpolated and stretched bands of the llama3 recipe.
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(tmp_path)
  lm = kvjax.load(tmp_path)
  assert lm.config.rope_scaling is not None and not lm.config.tie_embeddings

  ids = np.random.default_rng(0).integers(0, 64, (2, 300))
  with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(lm.forward(ids)), theirs, atol=1e-4, rtol=1e-4)

  # Through the paged cache: greedy tokens equal transformers' cached greedy decoding.
  result = kvjax.generate(lm, [ids[0].tolist()], max_new_tokens=8, stop_ids=[])
  tokens, x = [], torch.tensor(ids[:1])
  with torch.no_grad():
    out = model(x, use_cache=True)
    for _ in range(8):
      tokens.append(int(out.logits[0, -1].argmax()))
      out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                  use_cache=True)
  assert result.token_ids[0] == tokens
