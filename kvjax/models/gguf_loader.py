"""Loads a Llama- or Gemma 3-architecture GGUF file into a config and canonical weights.

The canonical weight dict is the one format every loader produces and the model
consumes: float32 numpy arrays, layers stacked along a leading L axis, matrices
stored [in, out] so the model computes x @ W. Keys (dimension letters as in
config.py):

  embed            [V, D]
  final_norm       [D]
  lm_head          [D, V]      only when config.tie_embeddings is False
  layers/attn_norm [L, D]
  layers/wq        [L, D, N*H]
  layers/wk        [L, D, K*H]
  layers/wv        [L, D, K*H]
  layers/wo        [L, N*H, D]
  layers/mlp_norm  [L, D]
  layers/w_gate    [L, D, F]
  layers/w_up      [L, D, F]
  layers/w_down    [L, F, D]

Query and key heads use the Hugging Face "rotate half" RoPE layout: llama.cpp
interleaves the two RoPE halves of each head of a Llama file, and this loader
undoes that.

A Gemma 3 file (general.architecture "gemma3") gives a Gemma3Config and, in
addition, ``layers/q_norm`` and ``layers/k_norm`` [L, H] and
``layers/post_attn_norm`` and ``layers/post_mlp_norm`` [L, D] (``mlp_norm`` is
the norm before the MLP). llama.cpp keeps Gemma's rotate-half rows as they
are (its NEOX RoPE), and stores every norm scale as applied (``1 + w``), which
is how kvjax keeps them. Its matrices come in K-quant blocks (Q4_K, Q6_K) and
Q5_0 / Q8_0, all dequantized with ``gguf.quants.dequantize``. What the file
does not say, llama.cpp's defaults for the architecture give: every 6th layer
global, local layers' RoPE base 10000, scores scaled by 1/sqrt(H).

With ``packed=True`` the matrices stored in a block format that kvjax's
kernels read (Q4_1, Q8_0: ``kvjax.kernels.quantized``) stay as the file's
blocks, uint8 rows ``[D_out, R]`` (stacked ``[L, D_out, R]``; the embedding
and lm_head ``[V, R]``), in place of the float arrays; other tensors are
dequantized as above.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from kvjax.kernels import quantized
from kvjax.models import config as config_lib
from kvjax.models.config import Gemma3Config, LlamaConfig, RopeScaling

# Per-layer GGUF tensor stem -> canonical key. Every one is required.
_LAYER_TENSORS = {
    "attn_norm": "layers/attn_norm",
    "attn_q": "layers/wq",
    "attn_k": "layers/wk",
    "attn_v": "layers/wv",
    "attn_output": "layers/wo",
    "ffn_norm": "layers/mlp_norm",
    "ffn_gate": "layers/w_gate",
    "ffn_up": "layers/w_up",
    "ffn_down": "layers/w_down",
}

# Gemma 3's per-layer tensors beyond the Llama ones (attn_q_norm / attn_k_norm
# ride on qk_norm).
_GEMMA3_LAYER_TENSORS = {
    "attn_q_norm": "layers/q_norm",
    "attn_k_norm": "layers/k_norm",
    "post_attention_norm": "layers/post_attn_norm",
    "post_ffw_norm": "layers/post_mlp_norm",
}

# general.architecture values this loader reads.
ARCHITECTURES = ("llama", "gemma3")

# Metadata arrays that are large and already exposed through GGUFTokenizerData;
# leaving them out of GGUFMetadata.fields keeps that dict small enough to print.
_BULKY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                 "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerData:
  """Everything a tokenizer needs from GGUF metadata (`tokenizer.ggml.*`)."""

  model: str  # tokenizer.ggml.model: "gpt2" is byte-level BPE, "llama" SentencePiece
  pre: str | None  # tokenizer.ggml.pre: which pre-tokenizer regexes llama.cpp uses
  tokens: tuple[str, ...]  # V strings, id -> token
  merges: tuple[str, ...]  # BPE merges "left right", best first
  token_types: tuple[int, ...]  # V llama.cpp token types (1 normal, 3 control, 4 user-defined)
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  unk_id: int | None
  add_bos: bool  # whether llama.cpp prepends BOS when encoding a prompt
  chat_template: str | None  # jinja2 source shipped with the model
  scores: tuple[float, ...] = ()  # V SentencePiece scores ("llama" model: BPE merge priority)
  add_space_prefix: bool = True  # "llama" model: prepend "▁" to the text, as SentencePiece does


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
  """What a GGUF file says besides its tensors."""

  path: str
  architecture: str  # general.architecture
  name: str  # general.name, or the file name when absent
  fields: dict[str, Any]  # scalar and small array metadata, raw GGUF keys
  tokenizer: GGUFTokenizerData


def canonical_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """The shape every canonical weight must have under `config`."""
  v, d, l, f = (config.vocab_size, config.hidden_size, config.num_layers,
                config.intermediate_size)
  qd = config.num_heads * config.head_dim  # N*H
  kd = config.num_kv_heads * config.head_dim  # K*H
  shapes = {
      "embed": (v, d),
      "final_norm": (d,),
      "layers/attn_norm": (l, d),
      "layers/wq": (l, d, qd),
      "layers/wk": (l, d, kd),
      "layers/wv": (l, d, kd),
      "layers/wo": (l, qd, d),
      "layers/mlp_norm": (l, d),
      "layers/w_gate": (l, d, f),
      "layers/w_up": (l, d, f),
      "layers/w_down": (l, f, d),
  }
  if not config.tie_embeddings:
    shapes["lm_head"] = (d, v)
  if config.attention_bias:
    shapes.update({"layers/bq": (l, qd), "layers/bk": (l, kd), "layers/bv": (l, kd)})
  if config.qk_norm:
    shapes.update({"layers/q_norm": (l, config.head_dim), "layers/k_norm": (l, config.head_dim)})
  if isinstance(config, Gemma3Config):
    shapes.update({"layers/post_attn_norm": (l, d), "layers/post_mlp_norm": (l, d)})
  return shapes


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head RoPE row interleave of an [out, in] matrix.

  llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)...; Hugging Face and kvjax
  rotate halves (x_i, x_{i+H/2}). The converter reordered each head's H rows
  from [half0 | half1] to [h0_0, h1_0, h0_1, h1_1, ...]; this puts them back.

  Args:
    w: [n_heads*H, D] projection, rows grouped by head.
    n_heads: N for the query projection, K for the key projection.

  Returns:
    [n_heads*H, D], same values with each head's rows in rotate-half order.
  """
  head_dim = w.shape[0] // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _field_value(field: gguf.ReaderField) -> Any:
  value = field.contents()
  # GGUF stores epsilons and bases as float32; printing 1e-05 beats 9.9999997e-06.
  if field.types and field.types[-1] == gguf.GGUFValueType.FLOAT32:
    if isinstance(value, list):
      return [float(str(np.float32(x))) for x in value]
    return float(str(np.float32(value)))
  return value


def _read_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
  # The bulky arrays are read once, by _tokenizer_data (262K entries for Gemma).
  return {name: _field_value(field) for name, field in reader.fields.items()
          if not name.startswith("GGUF.") and name not in _BULKY_FIELDS}


def _tokenizer_data(reader: gguf.GGUFReader, fields: dict[str, Any]) -> GGUFTokenizerData:
  def array(name):
    field = reader.fields.get(name)
    return tuple(field.contents()) if field is not None else ()

  def opt_int(name):
    value = fields.get(name)
    return int(value) if value is not None else None

  return GGUFTokenizerData(
      model=fields.get("tokenizer.ggml.model", ""),
      pre=fields.get("tokenizer.ggml.pre"),
      tokens=array("tokenizer.ggml.tokens"),
      merges=array("tokenizer.ggml.merges"),
      token_types=array("tokenizer.ggml.token_type"),
      bos_id=opt_int("tokenizer.ggml.bos_token_id"),
      eos_id=opt_int("tokenizer.ggml.eos_token_id"),
      pad_id=opt_int("tokenizer.ggml.padding_token_id"),
      unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
      add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
      chat_template=fields.get("tokenizer.chat_template"),
      scores=tuple(float(x) for x in array("tokenizer.ggml.scores")),
      add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
  )


def _metadata(reader: gguf.GGUFReader, path: str) -> GGUFMetadata:
  fields = _read_fields(reader)
  name = fields.get("general.name") or os.path.splitext(os.path.basename(path))[0]
  return GGUFMetadata(
      path=path,
      architecture=fields.get("general.architecture", ""),
      name=name,
      fields={k: v for k, v in fields.items() if k not in _BULKY_FIELDS},
      tokenizer=_tokenizer_data(reader, fields),
  )


def _open(path: str) -> gguf.GGUFReader:
  """A GGUFReader over ``path``; a file it cannot parse is a ValueError naming the file.

  The gguf package reports a truncated or corrupt file with numpy's messages
  (a failed reshape or view), which say nothing of the file or its state.
  """
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OSError, OverflowError) as e:
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or "
                     f"corrupt?): {e}") from e


def read_gguf_metadata(path: str | os.PathLike) -> GGUFMetadata:
  """Reads only the metadata (config keys, tokenizer) of a GGUF file; cheap."""
  path = os.fspath(path)
  return _metadata(_open(path), path)


def _llama3_factors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
  """Per-frequency divisors that llama3 rope scaling applies, [H/2]."""
  inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv_freq
  orig = scaling.original_max_position_embeddings
  smooth = (orig / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smooth = np.clip(smooth, 0.0, 1.0)
  # smooth 1 keeps a frequency, 0 divides it by factor; in between interpolates.
  return 1.0 / ((1 - smooth) / scaling.factor + smooth)


def _rope_scaling(fields: dict[str, Any], rope_freqs: np.ndarray | None, head_dim: int,
                  theta: float, path: str, arch: str = "llama") -> RopeScaling | None:
  kind = fields.get(f"{arch}.rope.scaling.type", "none")
  factor = fields.get(f"{arch}.rope.scaling.factor", 1.0)
  if kind not in ("none", "") and factor != 1.0:
    raise ValueError(
        f"{path}: rope scaling type {kind!r} (factor {factor}) is not supported; "
        "kvjax implements plain RoPE and llama3 scaling (a rope_freqs tensor)")
  if rope_freqs is None:
    return None
  # Llama 3.x GGUFs carry llama3 scaling as a `rope_freqs` tensor of per-frequency
  # divisors rather than as metadata; recover the parameters that produced it.
  rope_freqs = np.asarray(rope_freqs, np.float64).reshape(-1)
  if rope_freqs.shape != (head_dim // 2,):
    raise ValueError(f"{path}: tensor 'rope_freqs.weight' expected shape "
                     f"({head_dim // 2},), got {rope_freqs.shape}")
  if np.allclose(rope_freqs, 1.0):
    return None
  orig = int(fields.get(f"{arch}.rope.scaling.original_context_length", 8192))
  for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
    candidate = RopeScaling(factor=float(rope_freqs.max()), low_freq_factor=low,
                            high_freq_factor=high, original_max_position_embeddings=orig)
    if np.allclose(_llama3_factors(candidate, head_dim, theta), rope_freqs, rtol=1e-3):
      return candidate
  raise ValueError(f"{path}: tensor 'rope_freqs.weight' does not match llama3 rope "
                   f"scaling; got factors {rope_freqs.round(3).tolist()}")


# LlamaConfig field -> the GGUF metadata key it is read from (a Llama file's;
# other architectures replace the "llama." prefix, ``_keys``).
_KEYS = {
    "hidden_size": "llama.embedding_length",
    "num_layers": "llama.block_count",
    "num_heads": "llama.attention.head_count",
    "num_kv_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length",
    "intermediate_size": "llama.feed_forward_length",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base",
    "max_position_embeddings": "llama.context_length",
    "vocab_size": "token_embd.weight (its rows)",
}
_REQUIRED = ("hidden_size", "num_layers", "num_heads", "intermediate_size")


def _keys(arch: str) -> dict[str, str]:
  """_KEYS for general.architecture ``arch``."""
  return {field: key.replace("llama.", f"{arch}.", 1) for field, key in _KEYS.items()}


def _config_values(meta: GGUFMetadata, vocab_size: int) -> dict[str, Any]:
  """LlamaConfig dimensions of the metadata, checked against the schema (config.py)."""
  fields, path, arch = meta.fields, meta.path, meta.architecture
  keys = _keys(arch)
  values = {field: fields[key] for field, key in keys.items() if key in fields}
  missing = [keys[field] for field in _REQUIRED if field not in values]
  if missing:
    raise ValueError(f"{path}: metadata key {missing[0]!r} is missing")
  values["vocab_size"] = vocab_size
  config_lib.check_fields(values, path, keys)
  hidden, heads = values["hidden_size"], values["num_heads"]
  values.setdefault("num_kv_heads", heads)
  if "head_dim" not in values:
    if hidden % heads:
      raise ValueError(f"{path}: {arch}.embedding_length ({hidden}) is not a multiple of "
                       f"{arch}.attention.head_count ({heads}) and no key_length is given")
    values["head_dim"] = hidden // heads
  config_lib.check_fields(values, path, keys)  # the derived values too
  rot_dim = fields.get(f"{arch}.rope.dimension_count", values["head_dim"])
  if rot_dim != values["head_dim"]:
    raise ValueError(f"{path}: partial rotary embedding (rope.dimension_count "
                     f"{rot_dim!r} vs head_dim {values['head_dim']}) is not supported")
  return values


def _config(meta: GGUFMetadata, tensors: dict[str, gguf.ReaderTensor],
            rope_freqs: np.ndarray | None) -> LlamaConfig:
  path = meta.path
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{path}: required tensor 'token_embd.weight' is missing")
  # GGUF lists dimensions fastest-first, so the embedding reads [D, V].
  values = _config_values(meta, int(tensors["token_embd.weight"].shape[-1]))
  values["tie_embeddings"] = "output.weight" not in tensors
  config_lib.check_size(values, path, _keys(meta.architecture))
  theta = float(values.pop("rope_theta", 10000.0))
  scaling = _rope_scaling(meta.fields, rope_freqs, values["head_dim"], theta, path,
                          meta.architecture)
  if meta.architecture == "gemma3":
    if scaling is not None:
      raise ValueError(f"{path}: Gemma 3 with scaled RoPE is not supported")
    return Gemma3Config(**values, rope_theta=theta, name=str(meta.name),
                        **_gemma3_values(meta, values))
  return LlamaConfig(**values, rope_theta=theta, rope_scaling=scaling, name=str(meta.name))


def _gemma3_values(meta: GGUFMetadata, values: dict[str, Any]) -> dict[str, Any]:
  """Gemma3Config's own fields, from the metadata or, where it is silent, llama.cpp's
  defaults for the architecture (llama-model.cpp, LLM_ARCH_GEMMA3)."""
  fields, path = meta.fields, meta.path
  layers = values["num_layers"]
  window = fields.get("gemma3.attention.sliding_window", 4096)
  pattern = fields.get("gemma3.attention.sliding_window_pattern", 6)
  if isinstance(pattern, list):  # per layer: true where the layer is local
    if len(pattern) != layers or not all(isinstance(x, bool) for x in pattern):
      raise ValueError(f"{path}: gemma3.attention.sliding_window_pattern must hold {layers} "
                       f"booleans, got {pattern!r}")
    layer_types = tuple(config_lib.SLIDING if x else config_lib.FULL for x in pattern)
  elif config_lib.is_int(pattern) and pattern > 0:
    layer_types = config_lib.gemma3_layer_types(layers, pattern)
  else:
    raise ValueError(f"{path}: gemma3.attention.sliding_window_pattern must be a positive "
                     f"int or a list of booleans, got {pattern!r}")
  # llama.cpp scales scores by 1/sqrt(H), except for the 27B model (62 layers),
  # whose query_pre_attn_scalar is D / N.
  scalar = values["head_dim"]
  if layers == 62:
    scalar = values["hidden_size"] // values["num_heads"]
  cap = fields.get("gemma3.final_logit_softcapping")
  return dict(sliding_window=window, layer_types=layer_types,
              rope_local_theta=float(fields.get("gemma3.rope.freq_base_swa", 10000.0)),
              query_pre_attn_scalar=float(scalar),
              final_logit_softcapping=float(cap) if cap else None)


def _stored_shapes(config: LlamaConfig, shapes: dict[str, tuple[int, ...]]
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
  """(GGUF tensor name, its shape slowest dimension first) of every tensor the model needs.

  Layer by layer, lazily: a forged layer count fails at the first missing
  layer instead of listing them all.
  """
  yield "token_embd.weight", shapes["embed"]
  yield "output_norm.weight", shapes["final_norm"]
  if not config.tie_embeddings:
    yield "output.weight", shapes["lm_head"][::-1]
  for i in range(config.num_layers):
    for stem, key in _layer_tensors(config).items():
      yield f"blk.{i}.{stem}.weight", shapes[key][1:][::-1]


def _layer_tensors(config: LlamaConfig) -> dict[str, str]:
  """Per-layer GGUF tensor stem -> canonical key, for this config."""
  if isinstance(config, Gemma3Config):
    return {**_LAYER_TENSORS, **_GEMMA3_LAYER_TENSORS}
  return _LAYER_TENSORS


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
  """A GGUF tensor as float32 in numpy (row-major, slowest dimension first)."""
  values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  # A float32 tensor comes back as a view of the file's memory map; a copy
  # keeps no view alive, so the map (the whole file's pages) goes with the
  # reader instead of staying resident behind a weight.
  return np.array(values, np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def _packable(tensor: gguf.ReaderTensor) -> bool:
  """Whether kvjax's kernels read this matrix's blocks as stored."""
  return (len(tensor.shape) == 2 and tensor.tensor_type.name in quantized.FORMATS
          and int(tensor.shape[0]) % quantized.BLOCK == 0)


@dataclasses.dataclass(frozen=True)
class _Tensors:
  """A file's tensors by name, read shape-checked (``path`` starts every message)."""

  path: str
  by_name: dict[str, gguf.ReaderTensor]
  packed: bool  # keep Q4_1 / Q8_0 matrices as their blocks

  def keep_packed(self, names: list[str]) -> bool:
    """Whether to keep these tensors' blocks: one packable format for all (a stack's layers)."""
    found = [self.by_name.get(n) for n in names]
    return (self.packed and all(t is not None and _packable(t) for t in found)
            and len({t.tensor_type for t in found}) == 1)

  def check(self, name: str, want: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of GGUF tensor `name`, slowest dimension first, if it is `want`."""
    if name not in self.by_name:
      raise ValueError(f"{self.path}: required tensor {name!r} is missing")
    got = tuple(int(x) for x in reversed(self.by_name[name].shape.tolist()))
    if got != want:
      raise ValueError(f"{self.path}: tensor {name!r} expected shape {want}, got {got}")
    return got

  def fetch(self, name: str, want: tuple[int, ...], keep: bool = False) -> np.ndarray:
    """GGUF tensor `name` as float32 [out, in] (or [D]), or its rows of blocks; shape-checked."""
    got, tensor = self.check(name, want), self.by_name[name]
    # A copy either way: no weight views the file, whose map goes with the reader.
    return np.array(tensor.data, np.uint8).reshape(got[0], -1) if keep else _dequantize(tensor)


def _weights(tensors: _Tensors, config: LlamaConfig, shapes: dict[str, tuple[int, ...]],
             interleaved: bool) -> dict[str, np.ndarray]:
  """The canonical weights (see the module docstring) of a file whose shapes were checked.

  ``interleaved``: q and k rows are in llama.cpp's pairwise RoPE order (Llama files,
  not Gemma's), undone here.
  """
  # The embedding is [V, D], float or packed; lm_head [D, V] float or [V, R] packed.
  weights = {"embed": tensors.fetch("token_embd.weight", shapes["embed"],
                                    tensors.keep_packed(["token_embd.weight"])),
             "final_norm": tensors.fetch("output_norm.weight", shapes["final_norm"])}
  if not config.tie_embeddings:
    keep = tensors.keep_packed(["output.weight"])
    head = tensors.fetch("output.weight", shapes["lm_head"][::-1], keep)
    weights["lm_head"] = head if keep else head.T.copy()

  # Fill stacks layer by layer so peak memory stays near one copy.
  for stem, key in _layer_tensors(config).items():
    per_layer = shapes[key][1:]
    names = [f"blk.{i}.{stem}.weight" for i in range(config.num_layers)]
    keep = len(per_layer) == 2 and tensors.keep_packed(names)
    for i, name in enumerate(names):
      # GGUF matrices are [out, in] (canonical float ones [in, out]); RoPE rows
      # are reordered before the transpose.
      w = tensors.fetch(name, per_layer[::-1], keep)
      if interleaved and stem == "attn_q":
        w = unpermute_rope_rows(w, config.num_heads)
      elif interleaved and stem == "attn_k":
        w = unpermute_rope_rows(w, config.num_kv_heads)
      w = w if keep else w.T
      if i == 0:
        weights[key] = np.empty((config.num_layers, *w.shape), w.dtype)
      weights[key][i] = w
  return weights


def load_gguf(path: str | os.PathLike, *, packed: bool = False
              ) -> tuple[LlamaConfig, dict[str, np.ndarray], GGUFMetadata]:
  """Reads a Llama or Gemma 3 GGUF file into canonical weights (float32, or packed blocks).

  Args:
    path: a .gguf file whose general.architecture is "llama" or "gemma3".
    packed: keep Q4_1 / Q8_0 matrices as their blocks (see the module docstring).

  Returns:
    (config, weights, metadata): weights as described in the module docstring,
    metadata with the raw keys and the tokenizer data.

  Raises:
    ValueError: a truncated or corrupt file, another architecture, a missing
      tensor or metadata key, a metadata value that breaks the config schema
      (config.py), or a tensor whose shape disagrees with the metadata; all
      checked before any weight is allocated, the message starting with the
      file's path.
  """
  path = os.fspath(path)
  reader = _open(path)
  meta = _metadata(reader, path)
  # The parsed fields (a numpy view per vocabulary token and merge, ~150 MiB of
  # objects for a 49K vocabulary) are in ``meta`` now: drop them before the
  # weights are read, or loading peaks that much higher.
  reader.fields.clear()
  if meta.architecture not in ARCHITECTURES:
    raise ValueError(f"{path}: architecture {meta.architecture!r} is not supported; "
                     f"kvjax loads {' and '.join(repr(a) for a in ARCHITECTURES)} GGUF files")
  tensors = _Tensors(path, {t.name: t for t in reader.tensors}, packed)
  by_name = tensors.by_name
  rope_freqs = _dequantize(by_name["rope_freqs.weight"]) if "rope_freqs.weight" in by_name else None
  config = _config(meta, by_name, rope_freqs)
  shapes = canonical_shapes(config)
  # Every tensor's header agrees with the config before anything is allocated.
  for name, want in _stored_shapes(config, shapes):
    tensors.check(name, want)
  if not packed:  # (packed blocks take a fraction of that)
    config_lib.check_host_memory(config, path)
  return config, _weights(tensors, config, shapes, meta.architecture == "llama"), meta
