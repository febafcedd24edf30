"""Tests for kvjax.models.gguf_loader and kvjax.models.safetensors_loader.

Tiny GGUF files written here check the format handling (layout, RoPE row
order, errors); the real SmolLM2 GGUF is checked against transformers. Tiny
Hugging Face checkpoints saved by transformers check the safetensors loader.
"""

import os

import chex
import gguf
import numpy as np
import pytest

from kvjax.models import gguf_loader
from kvjax.models import registry
from kvjax.models import safetensors_loader
from kvjax.models.config import LlamaConfig, RopeScaling

SMOLLM2 = registry.KNOWN_MODELS["smollm2-135m-instruct"]

# A tiny Llama: D=16, N=4, K=2, H=4, F=24, V=32, L=2.
TINY = dict(vocab=32, d=16, n=4, k=2, h=4, f=24, layers=2)


def _llamacpp_permute(w, n_heads):
  """What llama.cpp's converter does to q/k rows (the inverse of what we undo)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
      .reshape(w.shape)


def _tiny_hf_weights(seed=0, tied=True):
  """Random [out, in] weights in Hugging Face layout, per layer."""
  rng = np.random.default_rng(seed)
  t = TINY
  w = {"embed": rng.normal(size=(t["vocab"], t["d"])).astype(np.float32),
       "final_norm": rng.normal(size=(t["d"],)).astype(np.float32)}
  if not tied:
    w["lm_head"] = rng.normal(size=(t["vocab"], t["d"])).astype(np.float32)
  shapes = {"attn_norm": (t["d"],), "ffn_norm": (t["d"],),
            "attn_q": (t["n"] * t["h"], t["d"]), "attn_k": (t["k"] * t["h"], t["d"]),
            "attn_v": (t["k"] * t["h"], t["d"]), "attn_output": (t["d"], t["n"] * t["h"]),
            "ffn_gate": (t["f"], t["d"]), "ffn_up": (t["f"], t["d"]),
            "ffn_down": (t["d"], t["f"])}
  for i in range(t["layers"]):
    for stem, shape in shapes.items():
      w[f"{i}.{stem}"] = rng.normal(size=shape).astype(np.float32)
  return w


def _write_tiny_gguf(path, hf, arch="llama", drop=(), reshape=None):
  """Writes `hf` weights as llama.cpp would (permuted q/k rows) into a GGUF file."""
  t = TINY
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name("tiny-llama")
  writer.add_block_count(t["layers"])
  writer.add_context_length(128)
  writer.add_embedding_length(t["d"])
  writer.add_feed_forward_length(t["f"])
  writer.add_head_count(t["n"])
  writer.add_head_count_kv(t["k"])
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_rope_freq_base(50000.0)
  tensors = {"token_embd.weight": hf["embed"], "output_norm.weight": hf["final_norm"]}
  if "lm_head" in hf:
    tensors["output.weight"] = hf["lm_head"]
  for i in range(t["layers"]):
    for stem in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_gate", "ffn_up", "ffn_down"):
      w = hf[f"{i}.{stem}"]
      if stem == "attn_q":
        w = _llamacpp_permute(w, t["n"])
      elif stem == "attn_k":
        w = _llamacpp_permute(w, t["k"])
      tensors[f"blk.{i}.{stem}.weight"] = w
  for name, value in tensors.items():
    if name in drop:
      continue
    if reshape and name in reshape:
      value = np.zeros(reshape[name], np.float32)
    writer.add_tensor(name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_round_trip(tmp_path, tied):
  hf = _tiny_hf_weights(tied=tied)
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", hf)
  config, weights, meta = gguf_loader.load_gguf(path)
  t = TINY
  assert config == LlamaConfig(
      vocab_size=t["vocab"], hidden_size=t["d"], num_layers=t["layers"], num_heads=t["n"],
      num_kv_heads=t["k"], head_dim=t["h"], intermediate_size=t["f"], rms_norm_eps=1e-6,
      rope_theta=50000.0, max_position_embeddings=128, tie_embeddings=tied,
      name="tiny-llama")
  assert meta.architecture == "llama" and meta.path == str(path)
  assert {k: w.shape for k, w in weights.items()} == gguf_loader.canonical_shapes(config)
  assert ("lm_head" in weights) == (not tied)
  chex.assert_type(list(weights.values()), np.float32)
  np.testing.assert_array_equal(weights["embed"], hf["embed"])
  np.testing.assert_array_equal(weights["final_norm"], hf["final_norm"])
  if not tied:
    np.testing.assert_array_equal(weights["lm_head"], hf["lm_head"].T)
  pairs = {"attn_q": "layers/wq", "attn_k": "layers/wk", "attn_v": "layers/wv",
           "attn_output": "layers/wo", "ffn_gate": "layers/w_gate", "ffn_up": "layers/w_up",
           "ffn_down": "layers/w_down", "attn_norm": "layers/attn_norm",
           "ffn_norm": "layers/mlp_norm"}
  for i in range(t["layers"]):
    for stem, key in pairs.items():
      np.testing.assert_array_equal(weights[key][i], hf[f"{i}.{stem}"].T, err_msg=f"{i} {key}")


def test_weights_hold_no_view_of_the_file(tmp_path):
  # A float32 tensor read as a view of the file's memory map would keep the
  # whole map resident for as long as the weight (or a device buffer aliasing
  # it) lives.
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights())
  _, weights, _ = gguf_loader.load_gguf(path)

  def bases(a):
    while a is not None:
      yield a
      a = a.base

  for key, w in weights.items():
    assert not any(isinstance(b, np.memmap) for b in bases(w)), key


def _rope_interleaved(x, pos, theta):
  """llama.cpp RoPE: rotates adjacent pairs (x0, x1), (x2, x3), ... of [..., H]."""
  h = x.shape[-1]
  ang = pos * theta ** (-np.arange(0, h, 2) / h)
  cos, sin = np.cos(ang), np.sin(ang)
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
  return out


def _rope_half(x, pos, theta):
  """Hugging Face RoPE: rotates (x_i, x_{i+H/2})."""
  h = x.shape[-1]
  ang = pos * theta ** (-np.arange(0, h, 2) / h)
  cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
  rotated = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * cos + rotated * sin


def test_unpermute_makes_rotate_half_rope_match_llamacpp():
  # Why the rows are reordered: scores q.k under llama.cpp's interleaved RoPE on
  # the file's rows equal scores under rotate-half RoPE on the unpermuted rows.
  rng = np.random.default_rng(1)
  n, h, d = 3, 8, 12
  w_file = rng.normal(size=(n * h, d))
  w_ours = gguf_loader.unpermute_rope_rows(w_file, n)
  np.testing.assert_array_equal(_llamacpp_permute(w_ours, n), w_file)
  x_q, x_k = rng.normal(size=d), rng.normal(size=d)
  for pos_q, pos_k in ((5, 2), (17, 0)):
    q_file, k_file = (w_file @ x_q).reshape(n, h), (w_file @ x_k).reshape(n, h)
    q_ours, k_ours = (w_ours @ x_q).reshape(n, h), (w_ours @ x_k).reshape(n, h)
    scores_file = np.sum(_rope_interleaved(q_file, pos_q, 1e4) *
                         _rope_interleaved(k_file, pos_k, 1e4), -1)
    scores_ours = np.sum(_rope_half(q_ours, pos_q, 1e4) * _rope_half(k_ours, pos_k, 1e4), -1)
    np.testing.assert_allclose(scores_ours, scores_file, rtol=1e-10)


def test_missing_tensor_names_tensor_and_file(tmp_path):
  path = _write_tiny_gguf(tmp_path / "t.gguf", _tiny_hf_weights(), drop=("blk.1.ffn_up.weight",))
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight") as info:
    gguf_loader.load_gguf(path)
  assert str(path) in str(info.value)


def test_wrong_shape_names_expected_and_got(tmp_path):
  path = _write_tiny_gguf(tmp_path / "t.gguf", _tiny_hf_weights(),
                          reshape={"blk.0.attn_v.weight": (4, 16)})
  with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*\(8, 16\).*\(4, 16\)"):
    gguf_loader.load_gguf(path)


def test_other_architecture_is_rejected(tmp_path):
  path = _write_tiny_gguf(tmp_path / "t.gguf", _tiny_hf_weights(), arch="qwen2")
  with pytest.raises(ValueError, match="'qwen2'"):
    gguf_loader.load_gguf(path)


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path):
  # Llama 3.x GGUFs store llama3 scaling as per-frequency divisors.
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)
  freqs = gguf_loader._llama3_factors(scaling, head_dim=TINY["h"], theta=50000.0)
  meta = {"llama.rope.scaling.original_context_length": 64}
  got = gguf_loader._rope_scaling(meta, freqs.astype(np.float32), TINY["h"], 50000.0, "x")
  assert got == scaling
  assert gguf_loader._rope_scaling({}, None, TINY["h"], 5e4, "x") is None
  with pytest.raises(ValueError, match="yarn"):
    gguf_loader._rope_scaling({"llama.rope.scaling.type": "yarn",
                               "llama.rope.scaling.factor": 4.0}, None, 4, 5e4, "x")


# --- the real model -----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
  return gguf_loader.load_gguf(smollm2_path)


def test_smollm2_config_and_metadata(smollm2):
  config, weights, meta = smollm2
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
          config.head_dim, config.intermediate_size, config.vocab_size) == \
      (30, 576, 9, 3, 64, 1536, 49152)
  assert config.rope_theta == 100000.0 and config.rope_scaling is None
  assert config.rms_norm_eps == 1e-5
  assert config.max_position_embeddings == 8192
  assert config.tie_embeddings and "lm_head" not in weights
  tok = meta.tokenizer
  assert (tok.model, tok.pre, tok.bos_id, tok.eos_id, tok.pad_id) == ("gpt2", "smollm", 1, 2, 2)
  assert len(tok.tokens) == 49152 and tok.tokens[2] == "<|im_end|>"
  assert not tok.add_bos
  assert "<|im_start|>" in tok.chat_template
  assert {k: w.shape for k, w in weights.items()} == gguf_loader.canonical_shapes(config)
  chex.assert_type(list(weights.values()), np.float32)


def test_read_metadata_matches_full_load(smollm2, smollm2_path):
  meta = gguf_loader.read_gguf_metadata(smollm2_path)
  assert meta == smollm2[2]


def test_smollm2_matches_transformers(smollm2, smollm2_hf):
  state = {k: v.detach().numpy() for k, v in smollm2_hf.state_dict().items()}
  _, weights, _ = smollm2
  np.testing.assert_array_equal(weights["embed"], state["model.embed_tokens.weight"])
  np.testing.assert_array_equal(weights["final_norm"], state["model.norm.weight"])
  names = {"layers/wq": "self_attn.q_proj", "layers/wk": "self_attn.k_proj",
           "layers/wv": "self_attn.v_proj", "layers/wo": "self_attn.o_proj",
           "layers/w_gate": "mlp.gate_proj", "layers/w_up": "mlp.up_proj",
           "layers/w_down": "mlp.down_proj", "layers/attn_norm": "input_layernorm",
           "layers/mlp_norm": "post_attention_layernorm"}
  for i in (0, 13, 29):
    for key, hf in names.items():
      ref = state[f"model.layers.{i}.{hf}.weight"]
      np.testing.assert_array_equal(weights[key][i], ref.T if ref.ndim == 2 else ref,
                                    err_msg=f"layer {i} {key}")


# --- Hugging Face safetensors checkpoints (kvjax.models.safetensors_loader) ---
# Kept here because both loaders produce the same canonical dict.

_HF_NAMES = {"layers/wq": "self_attn.q_proj", "layers/wk": "self_attn.k_proj",
             "layers/wv": "self_attn.v_proj", "layers/wo": "self_attn.o_proj",
             "layers/w_gate": "mlp.gate_proj", "layers/w_up": "mlp.up_proj",
             "layers/w_down": "mlp.down_proj", "layers/attn_norm": "input_layernorm",
             "layers/mlp_norm": "post_attention_layernorm"}


def _save_tiny_hf(folder, tied=False, dtype="float32", **save_kwargs):
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, intermediate_size=40, rms_norm_eps=1e-6,
      max_position_embeddings=16384, tie_word_embeddings=tied,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
      rope_theta=500000.0)
  model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
  with torch.no_grad():  # norms start at 1; randomize them so a mix-up would show
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p))
  model.save_pretrained(folder, **save_kwargs)
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _assert_same_as_hf(weights, state, layers=2):
  np.testing.assert_array_equal(weights["embed"], state["model.embed_tokens.weight"])
  np.testing.assert_array_equal(weights["final_norm"], state["model.norm.weight"])
  for i in range(layers):
    for key, hf in _HF_NAMES.items():
      ref = state[f"model.layers.{i}.{hf}.weight"]
      np.testing.assert_array_equal(weights[key][i], ref.T if ref.ndim == 2 else ref,
                                    err_msg=f"layer {i} {key}")


def test_safetensors_matches_transformers(tmp_path):
  state = _save_tiny_hf(tmp_path)
  config, weights = safetensors_loader.load_safetensors(tmp_path)
  assert config == LlamaConfig(
      vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
      intermediate_size=40, rms_norm_eps=1e-6, rope_theta=500000.0,
      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=16384,
      tie_embeddings=False, name=config.name)
  assert {k: w.shape for k, w in weights.items()} == gguf_loader.canonical_shapes(config)
  chex.assert_type(list(weights.values()), np.float32)
  _assert_same_as_hf(weights, state)
  np.testing.assert_array_equal(weights["lm_head"], state["lm_head.weight"].T)


def test_safetensors_tied_sharded_bfloat16(tmp_path):
  state = _save_tiny_hf(tmp_path, tied=True, dtype="bfloat16", max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  config, weights = safetensors_loader.load_safetensors(tmp_path)
  assert config.tie_embeddings and "lm_head" not in weights
  _assert_same_as_hf(weights, state)


def test_safetensors_missing_and_misshapen_tensors(tmp_path):
  import safetensors.numpy as safetensors_numpy
  _save_tiny_hf(tmp_path)
  file = tmp_path / "model.safetensors"
  tensors = safetensors_numpy.load_file(str(file))
  name = "model.layers.1.mlp.up_proj.weight"
  good = tensors.pop(name)
  safetensors_numpy.save_file(tensors, str(file))
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as info:
    safetensors_loader.load_safetensors(tmp_path)
  assert str(tmp_path) in str(info.value)
  tensors[name] = good[:, :-1].copy()
  safetensors_numpy.save_file(tensors, str(file))
  with pytest.raises(ValueError, match=r"up_proj\.weight.*\(40, 32\).*\(40, 31\)") as info:
    safetensors_loader.load_safetensors(tmp_path)
  assert str(file) in str(info.value)
