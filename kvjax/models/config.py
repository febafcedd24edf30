"""Model configuration for Llama-family decoders, and the schema every config obeys.

Dimension names used across kvjax (written once, used everywhere):
  B batch, T tokens, S cache slots, N query heads, K kv heads, G group (N // K),
  H head dim, D model width, F MLP width, V vocabulary, P pages, L layers.

Every config, whether built in code or read from a checkpoint's config.json or
GGUF metadata, passes one schema (``check_fields``) before anything is
allocated: positive ints for the dimensions, finite positive floats for RoPE's
base and the norm's epsilon, N a multiple of K, an even H, and an implied
parameter count below ``MAX_PARAMETERS``. The loaders run it on the file's
raw values, so that their messages name the file and its own key, and check
every tensor's shape against the config before reading any.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

# Far above any Llama-family checkpoint (the largest have ~4e11); a config
# implying more has a wrong dimension, and is refused before any allocation.
MAX_PARAMETERS = 10**12

POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "intermediate_size", "max_position_embeddings")
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
BOOLS = ("tie_embeddings", "attention_bias", "qk_norm")


def is_int(value: Any) -> bool:
  """An integer that is not a bool (JSON's true is not a dimension)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  """A real number that is not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_fields(values: Mapping[str, Any], source: str,
                 keys: Mapping[str, str] | None = None) -> None:
  """Checks the LlamaConfig fields present in ``values`` against the schema.

  Args:
    values: LlamaConfig field name -> raw value (fields absent are not checked).
    source: what messages start with: "LlamaConfig", a config.json or GGUF path.
    keys: field name -> the source's own name for it ("num_hidden_layers",
      "llama.block_count"), for messages; the field's name where absent.

  Raises:
    ValueError: "<source>: <key> must be ..., got <value>", for the first field
      of the wrong type or out of range, or fields that disagree.
  """
  keys = keys or {}

  def bad(field, rule):
    return ValueError(f"{source}: {keys.get(field, field)} must be {rule}, "
                      f"got {values[field]!r}")

  for field in POSITIVE_INTS:
    if field in values and (not is_int(values[field]) or values[field] <= 0):
      raise bad(field, "a positive int")
  for field in POSITIVE_FLOATS:
    value = values.get(field, 1.0)
    if not is_real(value) or not math.isfinite(value) or value <= 0:
      raise bad(field, "a finite positive number")
  for field in BOOLS:
    if field in values and not isinstance(values[field], bool):
      raise bad(field, "true or false")
  if "name" in values and not isinstance(values["name"], str):
    raise bad("name", "a string")
  heads, kv_heads = values.get("num_heads"), values.get("num_kv_heads")
  if heads is not None and kv_heads is not None and heads % kv_heads:
    raise bad("num_heads", f"a multiple of {keys.get('num_kv_heads', 'num_kv_heads')} "
                           f"({kv_heads})")
  if values.get("head_dim", 2) % 2:
    raise bad("head_dim", "even (RoPE rotates pairs)")


def parameter_count(values: Mapping[str, Any]) -> int:
  """Parameters of a Llama decoder with these (checked) dimensions; Python ints, no overflow."""
  v, d, l, f = (values["vocab_size"], values["hidden_size"], values["num_layers"],
                values["intermediate_size"])
  q = values["num_heads"] * values["head_dim"]  # N*H
  kv = values["num_kv_heads"] * values["head_dim"]  # K*H
  per_layer = 2 * d + d * (q + 2 * kv) + q * d + 3 * d * f
  if values.get("attention_bias"):
    per_layer += q + 2 * kv
  if values.get("qk_norm"):
    per_layer += 2 * values["head_dim"]
  head = 0 if values.get("tie_embeddings", True) else v * d
  return v * d + head + d + l * per_layer


def check_size(values: Mapping[str, Any], source: str,
               keys: Mapping[str, str] | None = None) -> None:
  """Refuses dimensions that imply more than MAX_PARAMETERS parameters (a wrong dimension).

  ``source`` and ``keys`` as in ``check_fields``.
  """
  count, keys = parameter_count(values), keys or {}
  if count > MAX_PARAMETERS:
    dims = ", ".join(f"{keys.get(k, k)}={values[k]}" for k in POSITIVE_INTS if k in values)
    raise ValueError(f"{source}: the dimensions ({dims}) imply {count:.3g} parameters "
                     f"({4 * count / 2**30:.3g} GiB as float32), more than the "
                     f"{MAX_PARAMETERS:.0e} of any model kvjax loads; a dimension is wrong")


def physical_memory() -> int | None:
  """Bytes of this machine's physical memory, or None where the OS does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_host_memory(config: LlamaConfig, source: str, bytes_per_parameter: int = 4) -> None:
  """Refuses a load whose host copy of the weights exceeds the machine's physical memory.

  The loaders hold every weight on the host (float32: 4 bytes a parameter)
  before the model is built; a checkpoint larger than the machine's memory
  would fail partway through with a MemoryError, or be killed.
  """
  need, have = config.num_parameters * bytes_per_parameter, physical_memory()
  if have is not None and need > have:
    raise ValueError(f"{source}: the weights need {need / 2**30:.1f} GiB of host memory "
                     f"({config.num_parameters:.3g} parameters, {bytes_per_parameter} bytes "
                     f"each), more than this machine's {have / 2**30:.1f} GiB")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x frequency scaling of RoPE ("llama3" rope_type in transformers)."""

  factor: float = 8.0  # how much the context was stretched
  low_freq_factor: float = 1.0  # wavelengths above original/low_freq are divided by factor
  high_freq_factor: float = 4.0  # wavelengths below original/high_freq are kept
  original_max_position_embeddings: int = 8192  # context of the unscaled model

  def __post_init__(self):
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
      value = getattr(self, field)
      if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"RopeScaling.{field} must be a finite positive number, got {value!r}")
    if not is_int(self.original_max_position_embeddings) or \
        self.original_max_position_embeddings <= 0:
      raise ValueError("RopeScaling.original_max_position_embeddings must be a positive int, "
                       f"got {self.original_max_position_embeddings!r}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"high_freq_factor ({self.high_freq_factor}) must exceed "
          f"low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """How a mesh's model axis splits a model's weights, by parameter name.

  A model module states its own (``Llama.sharding_rules``) and
  ``kvjax.sharding.layout`` reads them off the model it is given, so sharding
  imports no model module. Every parameter not named is replicated.
  """

  head_columns: tuple[str, ...] = ()  # fused [q | k | v] columns: split by head, per part
  mlp_columns: tuple[str, ...] = ()  # fused [gate | up] columns: split by column, per part
  row_split: tuple[str, ...] = ()  # input axis (-2) holds heads or MLP columns: split it


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a Llama-family decoder (SmolLM2, Llama 3.x, Mistral)."""

  vocab_size: int  # V
  hidden_size: int  # D
  num_layers: int  # L
  num_heads: int  # N query heads
  num_kv_heads: int  # K key/value heads; N must be a multiple of K (GQA)
  head_dim: int  # H
  intermediate_size: int  # F, SwiGLU width
  rms_norm_eps: float = 1e-5  # epsilon inside RMSNorm
  rope_theta: float = 10000.0  # RoPE base
  rope_scaling: RopeScaling | None = None  # llama3 scaling, None for plain RoPE
  max_position_embeddings: int = 8192  # longest context the model was trained for
  tie_embeddings: bool = True  # lm_head shares the embedding matrix
  attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
  qk_norm: bool = False  # q and k each RMS-normed per head before RoPE (Qwen3)
  name: str = "llama"  # for messages and result rows

  def __post_init__(self):
    values = _values(self)
    check_fields(values, "LlamaConfig")
    check_size(values, "LlamaConfig")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, "
                       f"got {self.rope_scaling!r}")

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """Per layer: the keys a query may see, 0 where unlimited (every layer here).

    Sliding-window models (Gemma3Config) give their local layers' window; the
    paged cache can look a layer's window up in this static table.
    """
    return (0,) * self.num_layers

  @property
  def global_layers(self) -> tuple[int, ...]:
    """The layers without a sliding window: those a policy's budget sizes (and
    Duo's gates cover); a local layer's cache is a ring of its window."""
    return tuple(layer for layer, w in enumerate(self.layer_windows) if not w)

  @property
  def group_size(self) -> int:
    """G: query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def num_parameters(self) -> int:
    """Parameters of the model (embedding, layers, final norm, and lm_head when untied)."""
    return parameter_count(_values(self))


def _values(config: LlamaConfig) -> dict[str, Any]:
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


# Gemma 3's layer kinds, as transformers' config.json names them.
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
  """Gemma 3's default interleave: every ``pattern``-th layer global, the rest local.

  Layers ``pattern - 1``, ``2 * pattern - 1``, ... attend to the whole
  context (llama.cpp's ``set_swa_pattern`` and transformers' ``layer_types``
  agree on this order).
  """
  return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
  """Gemma 3 (text): a Llama-shaped decoder with local and global layers.

  Differences from LlamaConfig's decoder: the embedding is scaled by
  sqrt(D); q and k are RMS-normed per head (``qk_norm`` is always True);
  RMS norms sit before and after attention and the MLP; the MLP is GeGLU
  (tanh-approximated GELU); local layers attend to the last
  ``sliding_window`` positions (the query's own included) with RoPE base
  ``rope_local_theta``, global layers to everything with ``rope_theta``.
  Norm scales are stored as applied (Gemma's ``1 + w``, as llama.cpp's GGUF
  files already hold them).
  """

  qk_norm: bool = True  # always: Gemma 3 norms q and k per head
  sliding_window: int = 512  # keys a local layer's query sees, itself included
  layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = gemma3_layer_types
  rope_local_theta: float = 10000.0  # RoPE base of local layers (rope_theta: global ones)
  query_pre_attn_scalar: float = 256.0  # scores are q.k / sqrt(this), not / sqrt(H)
  final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c); None: off
  name: str = "gemma3"

  def __post_init__(self):
    if not self.layer_types:
      object.__setattr__(self, "layer_types", gemma3_layer_types(self.num_layers))
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    super().__post_init__()
    if not self.qk_norm:
      raise ValueError("Gemma3Config.qk_norm must be True (Gemma 3 norms q and k)")
    if self.rope_scaling is not None:
      raise ValueError("Gemma3Config.rope_scaling must be None: Gemma 3's scaled RoPE "
                       "(the 4B and larger models) is not implemented")
    if not is_int(self.sliding_window) or self.sliding_window <= 0:
      raise ValueError(f"Gemma3Config.sliding_window must be a positive int, "
                       f"got {self.sliding_window!r}")
    if len(self.layer_types) != self.num_layers or \
        any(t not in (SLIDING, FULL) for t in self.layer_types):
      raise ValueError(f"Gemma3Config.layer_types must name {self.num_layers} layers, each "
                       f"{SLIDING!r} or {FULL!r}, got {self.layer_types!r}")
    for field in ("rope_local_theta", "query_pre_attn_scalar"):
      value = getattr(self, field)
      if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Gemma3Config.{field} must be a finite positive number, "
                         f"got {value!r}")
    cap = self.final_logit_softcapping
    if cap is not None and (not is_real(cap) or not math.isfinite(cap) or cap <= 0):
      raise ValueError(f"Gemma3Config.final_logit_softcapping must be None or a finite "
                       f"positive number, got {cap!r}")

  @property
  def local_layers(self) -> tuple[bool, ...]:
    """Per layer: whether it attends only to its last ``sliding_window`` positions."""
    return tuple(t == SLIDING for t in self.layer_types)

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """Per layer: the keys a query may see (``sliding_window``), 0 where unlimited."""
    return tuple(self.sliding_window if local else 0 for local in self.local_layers)

  @property
  def layer_rope_thetas(self) -> tuple[float, ...]:
    """Per layer: its RoPE base."""
    return tuple(self.rope_local_theta if local else self.rope_theta
                 for local in self.local_layers)

  @property
  def num_parameters(self) -> int:
    """As LlamaConfig's, plus the norms after attention and after the MLP."""
    return super().num_parameters + 2 * self.num_layers * self.hidden_size


def config_class(name: str) -> type[LlamaConfig]:
  """The config class of ``type(config).__name__`` (what the weight cache records)."""
  classes = {c.__name__: c for c in (LlamaConfig, Gemma3Config)}
  if name not in classes:
    raise ValueError(f"unknown config class {name!r}; known: {', '.join(classes)}")
  return classes[name]
