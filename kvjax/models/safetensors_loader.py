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
import math
import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors import safe_open

from kvjax.models import config as config_lib
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

# Per-layer tensors of some architectures only: (LlamaConfig flag, suffix -> canonical key).
_OPTIONAL_LAYER_TENSORS = (
    ("attention_bias", {"self_attn.q_proj.bias": "layers/bq", "self_attn.k_proj.bias": "layers/bk",
                        "self_attn.v_proj.bias": "layers/bv"}),
    ("qk_norm", {"self_attn.q_norm.weight": "layers/q_norm",
                 "self_attn.k_norm.weight": "layers/k_norm"}),
)

# model_type values whose checkpoints are Llama decoders for our purposes, and
# what their config implies beyond config.json's keys: Qwen2's q/k/v carry
# biases, Qwen3 RMS-norms q and k per head.
_LLAMA_LIKE = {"llama": {}, "mistral": {}, "qwen2": {"attention_bias": True},
               "qwen3": {"qk_norm": True}}


def _layer_tensors(config: LlamaConfig) -> dict[str, str]:
  """Per-layer Hugging Face tensor suffix -> canonical key, for this config."""
  tensors = dict(_LAYER_TENSORS)
  for flag, extra in _OPTIONAL_LAYER_TENSORS:
    if getattr(config, flag):
      tensors.update(extra)
  return tensors


# LlamaConfig field -> the config.json key it is read from.
_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")
# Keys that may be absent or null (a default or a value derived from others).
_OPTIONAL = {"num_key_value_heads", "head_dim"}


def _number(table: dict[str, Any], key: str, where: str, default=None) -> float:
  """table[key] as a finite float; an absent key gives `default` (None: required)."""
  value = table.get(key, default)
  if value is None:
    raise ValueError(f"{where}: {key} is missing")
  if not config_lib.is_real(value) or not math.isfinite(value):
    raise ValueError(f"{where}: {key} must be a finite number, got {value!r}")
  return float(value)


def _rope(cfg: dict[str, Any], path: pathlib.Path) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from either transformers 4 or 5 style config.json."""
  # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
  for key in ("rope_parameters", "rope_scaling"):
    if cfg.get(key) is not None and not isinstance(cfg[key], dict):
      raise ValueError(f"{path}: {key} must be an object or null, got {cfg[key]!r}")
  params = dict(cfg.get("rope_parameters") or {})
  scaling = dict(cfg.get("rope_scaling") or {})
  theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
  config_lib.check_fields({"rope_theta": theta}, str(path))
  merged = {**scaling, **params}
  kind = merged.get("rope_type", merged.get("type", "default"))
  if kind in ("default", None):
    return float(theta), None
  if kind != "llama3":
    raise ValueError(f"{path}: rope scaling type {kind!r} is not supported; "
                     "kvjax implements plain RoPE and 'llama3' scaling")
  where = f"{path}: rope scaling"
  original = merged.get("original_max_position_embeddings")
  if not config_lib.is_int(original):
    raise ValueError(f"{where}: original_max_position_embeddings must be a positive int, "
                     f"got {original!r}")
  factors = {key: _number(merged, key, where)
             for key in ("factor", "low_freq_factor", "high_freq_factor")}
  try:
    return float(theta), RopeScaling(**factors, original_max_position_embeddings=original)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def _read_json_object(path: pathlib.Path) -> dict[str, Any]:
  try:
    cfg = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise ValueError(f"{path}: not valid JSON: {e}") from e
  if not isinstance(cfg, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
  return cfg


def _check_architecture(cfg: dict[str, Any], path: pathlib.Path) -> None:
  model_type = cfg.get("model_type")
  if model_type not in _LLAMA_LIKE:
    raise ValueError(f"{path}: model_type {model_type!r} is not supported; "
                     f"kvjax loads {', '.join(_LLAMA_LIKE)} checkpoints")
  if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
    raise ValueError(f"{path}: layer_types other than full_attention are not supported")
  if model_type == "mistral" and cfg.get("sliding_window"):
    raise ValueError(f"{path}: sliding-window attention ({cfg['sliding_window']}) "
                     "is not supported")
  if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
    raise ValueError(f"{path}: sliding-window attention (use_sliding_window) is not supported")
  # Qwen2's q/k/v biases are read; Llama's and Qwen3's attention_bias also puts one on
  # the output projection, which the model does not have.
  if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
    raise ValueError(f"{path}: attention or MLP biases are not supported for {model_type}")


def config_from_json(path: str | os.PathLike) -> LlamaConfig:
  """Reads a Hugging Face `config.json` of a Llama-like model.

  Every dimension is checked (config.py's schema) before the config exists,
  so nothing is allocated for a file with missing, mistyped or absurd values.

  Raises:
    ValueError: "<path>: <key> must be ..." naming the file and its key.
  """
  path = pathlib.Path(path)
  cfg = _read_json_object(path)
  missing = [key for key in _REQUIRED if key not in cfg]
  if missing:
    raise ValueError(f"{path}: required key(s) {missing} missing")
  _check_architecture(cfg, path)
  values = {field: cfg[key] for field, key in _KEYS.items()
            if key in cfg and not (key in _OPTIONAL and cfg[key] is None)}
  values.setdefault("tie_embeddings", False)
  config_lib.check_fields(values, str(path), _KEYS)
  heads, hidden = values["num_heads"], values["hidden_size"]
  values.setdefault("num_kv_heads", heads)
  if "head_dim" not in values:
    if hidden % heads:
      raise ValueError(f"{path}: hidden_size ({hidden}) is not a multiple of "
                       f"num_attention_heads ({heads}) and no head_dim is given")
    values["head_dim"] = hidden // heads
  config_lib.check_fields(values, str(path), _KEYS)  # the derived values too
  config_lib.check_size(values, str(path), _KEYS)
  theta, scaling = _rope(cfg, path)
  name = cfg.get("_name_or_path") or path.parent.name
  implied = _LLAMA_LIKE[cfg["model_type"]]
  return LlamaConfig(**values, **implied, rope_theta=theta, rope_scaling=scaling, name=str(name))


def _shard_of_tensor(folder: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> file that holds it."""
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) for file in weight_map.values()):
      raise ValueError(f"{index}: weight_map must be an object of tensor name -> file name")
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

  def check(self, name: str, want: tuple[int, ...]):
    """The open shard holding tensor ``name``, whose header says shape ``want``; reads no data."""
    file = self._where.get(name)
    if file is None:
      raise ValueError(f"{self._folder}: required tensor {name!r} is missing")
    handle = self._handle(file, "numpy")
    if name not in handle.keys():
      raise ValueError(f"{file}: required tensor {name!r} is missing")
    got = tuple(handle.get_slice(name).get_shape())
    if got != want:
      raise ValueError(f"{file}: tensor {name!r} expected shape {want}, got {got}")
    return file, handle

  def get(self, name: str, want: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name`` as float32, after ``check``."""
    file, handle = self.check(name, want)
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
    ValueError: unsupported model type, a config.json value that breaks the
      schema (config.py), a missing tensor, or a wrong shape; checked before
      any weight is allocated, the message naming the file.
  """
  folder = pathlib.Path(directory)
  if not (folder / "config.json").is_file():
    raise ValueError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
  config = config_from_json(folder / "config.json")
  shapes = canonical_shapes(config)
  weights = {}
  where = _shard_of_tensor(folder)
  with _Reader(where, folder) as reader:
    # Every header agrees with the config before anything is allocated.
    needed = set()
    for name, want in _stored_shapes(config, shapes):
      reader.check(name, want)
      needed.add(name)
    _check_nothing_left_over(where, needed, config, folder)
    config_lib.check_host_memory(config, str(folder))
    weights["embed"] = reader.get("model.embed_tokens.weight", shapes["embed"])
    weights["final_norm"] = reader.get("model.norm.weight", shapes["final_norm"])
    if not config.tie_embeddings:
      weights["lm_head"] = reader.get("lm_head.weight", shapes["lm_head"][::-1]).T.copy()
    layer_tensors = _layer_tensors(config)
    for key in layer_tensors.values():
      weights[key] = np.empty(shapes[key], np.float32)
    for i in range(config.num_layers):
      for suffix, key in layer_tensors.items():
        w = reader.get(f"model.layers.{i}.{suffix}", shapes[key][1:][::-1])
        weights[key][i] = w.T
  return config, weights


# Tensors a checkpoint may hold that are no weights of the model: RoPE's inverse
# frequencies (older Llama exports), which the config determines.
_NOT_WEIGHTS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _check_nothing_left_over(where: dict[str, pathlib.Path], needed: set[str],
                             config: LlamaConfig, folder: pathlib.Path) -> None:
  """Raises ValueError for tensors the config does not account for (a config that says
  fewer layers than the weights hold, another architecture's weights), naming them."""
  extra = sorted(name for name in where if name not in needed and not _NOT_WEIGHTS.fullmatch(name)
                 and not (config.tie_embeddings and name == "lm_head.weight"))
  if extra:
    shown = ", ".join(repr(n) for n in extra[:4]) + (f" and {len(extra) - 4} more"
                                                     if len(extra) > 4 else "")
    raise ValueError(f"{folder}: the weights hold {len(extra)} tensor(s) that config.json "
                     f"(num_hidden_layers={config.num_layers}) does not account for: {shown}")


def _stored_shapes(config: LlamaConfig, shapes: dict[str, tuple[int, ...]]
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
  """(tensor name, stored shape) of every tensor the model needs, layer by layer, lazily.

  Hugging Face stores matrices [out, in]; canonical ones are [in, out]. Lazily,
  so that a forged layer count fails at the first missing layer.
  """
  yield "model.embed_tokens.weight", shapes["embed"]
  yield "model.norm.weight", shapes["final_norm"]
  if not config.tie_embeddings:
    yield "lm_head.weight", shapes["lm_head"][::-1]
  for i in range(config.num_layers):
    for suffix, key in _layer_tensors(config).items():
      yield f"model.layers.{i}.{suffix}", shapes[key][1:][::-1]
