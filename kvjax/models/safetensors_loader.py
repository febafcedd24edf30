"""Loads a Hugging Face Llama checkpoint folder into a LlamaConfig and canonical weights.

The folder holds `config.json` and either `model.safetensors` or shards listed
in `model.safetensors.index.json`. The canonical weight dict is the one
gguf_loader.py documents: float32, layers stacked on a leading L axis,
matrices [in, out]. Hugging Face already uses rotate-half RoPE, so query and
key rows need no reordering.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors import safe_open

from kvjax.models.config import LlamaConfig, RopeScaling
from kvjax.models.gguf_loader import canonical_shapes

# Per-layer Hugging Face tensor suffix -> canonical key.
_LAYER_TENSORS = {
    "input_layernorm.weight": "layers/attn_norm",
    "self_attn.q_proj.weight": "layers/wq",
    "self_attn.k_proj.weight": "layers/wk",
    "self_attn.v_proj.weight": "layers/wv",
    "self_attn.o_proj.weight": "layers/wo",
    "post_attention_layernorm.weight": "layers/mlp_norm",
    "mlp.gate_proj.weight": "layers/w_gate",
    "mlp.up_proj.weight": "layers/w_up",
    "mlp.down_proj.weight": "layers/w_down",
}

# model_type values whose checkpoints are plain Llama decoders for our purposes.
_LLAMA_LIKE = ("llama", "mistral")


def _rope(cfg: dict[str, Any], path: pathlib.Path) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from either transformers 4 or 5 style config.json."""
  # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
  params = dict(cfg.get("rope_parameters") or {})
  scaling = dict(cfg.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
  merged = {**scaling, **params}
  kind = merged.get("rope_type", merged.get("type", "default"))
  if kind in ("default", None):
    return theta, None
  if kind != "llama3":
    raise ValueError(f"{path}: rope scaling type {kind!r} is not supported; "
                     "kvjax implements plain RoPE and 'llama3' scaling")
  return theta, RopeScaling(
      factor=float(merged["factor"]),
      low_freq_factor=float(merged["low_freq_factor"]),
      high_freq_factor=float(merged["high_freq_factor"]),
      original_max_position_embeddings=int(merged["original_max_position_embeddings"]))


def config_from_json(path: str | os.PathLike) -> LlamaConfig:
  """Reads a Hugging Face `config.json` of a Llama-like model."""
  path = pathlib.Path(path)
  try:
    cfg = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON: {e}") from e
  if not isinstance(cfg, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
  missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers",
                             "num_attention_heads", "intermediate_size") if key not in cfg]
  if missing:
    raise ValueError(f"{path}: required key(s) {missing} missing")
  model_type = cfg.get("model_type")
  if model_type not in _LLAMA_LIKE:
    raise ValueError(f"{path}: model_type {model_type!r} is not supported; "
                     f"kvjax loads {', '.join(_LLAMA_LIKE)} checkpoints")
  if model_type == "mistral" and cfg.get("sliding_window"):
    raise ValueError(f"{path}: sliding-window attention ({cfg['sliding_window']}) "
                     "is not supported")
  if cfg.get("attention_bias") or cfg.get("mlp_bias"):
    raise ValueError(f"{path}: attention or MLP biases are not supported")
  heads = int(cfg["num_attention_heads"])
  hidden = int(cfg["hidden_size"])
  theta, scaling = _rope(cfg, path)
  return LlamaConfig(
      vocab_size=int(cfg["vocab_size"]),
      hidden_size=hidden,
      num_layers=int(cfg["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
      head_dim=int(cfg.get("head_dim") or hidden // heads),
      intermediate_size=int(cfg["intermediate_size"]),
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      name=cfg.get("_name_or_path") or path.parent.name,
  )


def _shard_of_tensor(folder: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> file that holds it."""
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    return {name: folder / file for name, file in weight_map.items()}
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise ValueError(f"{folder}: no *.safetensors files")
  where = {}
  for file in files:
    with _safe_open(file, "numpy") as f:
      where.update({name: file for name in f.keys()})
  return where


def _safe_open(file: pathlib.Path, framework: str):
  """safe_open, with a truncated or corrupt file reported as a ValueError naming it.

  safetensors raises its own SafetensorError, which is not a ValueError and
  does not name the file.
  """
  if not file.is_file():
    raise ValueError(f"{file}: file is missing")
  try:
    return safe_open(str(file), framework=framework)
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"{file}: not a readable safetensors file ({file.stat().st_size} bytes; "
                     f"truncated or corrupt?): {e}") from e


class _Reader:
  """Opens each shard once and returns float32 numpy tensors from any of them."""

  def __init__(self, where: dict[str, pathlib.Path], folder: pathlib.Path):
    self._where = where
    self._folder = folder
    self._stack = contextlib.ExitStack()
    self._handles = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._stack.close()

  def _handle(self, file: pathlib.Path, framework: str):
    key = (file, framework)
    if key not in self._handles:
      self._handles[key] = self._stack.enter_context(_safe_open(file, framework))
    return self._handles[key]

  def get(self, name: str, want: tuple[int, ...]) -> np.ndarray:
    file = self._where.get(name)
    if file is None:
      raise ValueError(f"{self._folder}: required tensor {name!r} is missing")
    handle = self._handle(file, "numpy")
    if name not in handle.keys():
      raise ValueError(f"{file}: required tensor {name!r} is missing")
    got = tuple(handle.get_slice(name).get_shape())
    if got != want:
      raise ValueError(f"{file}: tensor {name!r} expected shape {want}, got {got}")
    if handle.get_slice(name).get_dtype() == "BF16":
      # numpy has no bfloat16; the flax reader returns a jax array we widen on host.
      import jax  # pylint: disable=g-import-not-at-top
      with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(self._handle(file, "flax").get_tensor(name), np.float32)
    return np.asarray(handle.get_tensor(name), np.float32)


def load_safetensors(directory: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face Llama checkpoint folder into float32 canonical weights.

  Args:
    directory: folder with config.json and model.safetensors (or shards + index).

  Returns:
    (config, weights) with weights as documented in gguf_loader.py.

  Raises:
    ValueError: unsupported model type, a missing tensor, or a wrong shape.
  """
  folder = pathlib.Path(directory)
  if not (folder / "config.json").is_file():
    raise ValueError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
  config = config_from_json(folder / "config.json")
  shapes = canonical_shapes(config)
  weights = {}
  with _Reader(_shard_of_tensor(folder), folder) as reader:
    weights["embed"] = reader.get("model.embed_tokens.weight", shapes["embed"])
    weights["final_norm"] = reader.get("model.norm.weight", shapes["final_norm"])
    if not config.tie_embeddings:
      # Hugging Face stores [out, in] = [V, D]; canonical is [in, out].
      weights["lm_head"] = reader.get("lm_head.weight", shapes["lm_head"][::-1]).T.copy()
    for key in _LAYER_TENSORS.values():
      weights[key] = np.empty(shapes[key], np.float32)
    for i in range(config.num_layers):
      for suffix, key in _LAYER_TENSORS.items():
        per_layer = shapes[key][1:]
        w = reader.get(f"model.layers.{i}.{suffix}", per_layer[::-1])
        weights[key][i] = w.T
  return config, weights
