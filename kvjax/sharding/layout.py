"""Where each array of a generate run lives on a (data, model) mesh.

  weights        q, k, v, gate and up columns, and the rows of the output and
                 down projections, split over ``model`` by head and MLP column
                 (tensor parallel); everything else replicated. The model
                 states which parameters those are (its module's
                 ``sharding_rules``, read off the model it is given), so this
                 file imports no model module
  paged cache    each device owns a block of the page pool holding the pages
                 of its sequences (``data``) and KV heads (``model``); its page
                 table, lengths and free stack are its own (never replicated)
  per sequence   tokens, lengths, logits split over ``data``

Every program runs per device (``kvjax.sharding.programs``), on the local
view of these arrays: a model with N / M query heads, K / M KV heads and F / M
MLP columns, and a cache of B / D sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache.paged import PagedKVCache, _capacity_table
from kvjax.sharding.mesh import DATA, MODEL, check_mesh, mesh_sizes

# What one array of a program is, on the mesh -> its PartitionSpec (a prefix
# of its pytree). "cache" and "params" have specs per field (below).
SPECS = {
    "batch": P(DATA),  # [B, ...] per sequence
    "heads": P(DATA, None, MODEL),  # [B, L, K, ...] per sequence and KV head
    "recorded": P(None, DATA, None, MODEL),  # [L, B, T, N or K, H]
    "replicated": P(),
}
_POOL = P((DATA, MODEL))  # [P, ...] page pools, free stacks: a block per device
_POOL_FIELDS = ("k_pages", "v_pages", "positions", "scores", "free_pages")  # [P, ...] arrays


def sharding(mesh: Mesh, spec: P) -> NamedSharding:
  return NamedSharding(mesh, spec)


# ------------------------------------------------------------------- the model

_ON_MESH: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def shard_model(lm, mesh: Mesh):
  """``lm`` laid over ``mesh``: weights split over the model axis, the per-device graph.

  The result is what generate's programs take on a mesh: its ``params`` are
  global arrays (fused q/k/v and gate/up columns reordered so each model
  shard's block holds its own heads' and columns' parts), its ``graphdef``
  the local model's (N / M, K / M, F / M); its ``config`` stays the whole
  model's. Cached per (model, mesh).

  Raises:
    ValueError: packed GGUF weights (load with ``packed=False``), or a mesh
      that does not split the model (``check_mesh``).
  """
  check_mesh(mesh, lm.config)
  cached = _ON_MESH.setdefault(lm, {})
  if mesh not in cached:
    if lm.packed:
      raise ValueError("a model with packed GGUF weights cannot be sharded over a mesh yet; "
                       "load it with packed=False")
    module = type(lm.module)  # Llama, or Gemma3 for a Gemma3Config
    cached[mesh] = dataclasses.replace(
        lm, graphdef=_local_graphdef(lm, module, mesh_sizes(mesh)[1]),
        params=_shard_params(lm, module.sharding_rules, mesh))
  return cached[mesh]


def local_config(config, model_shards: int):
  """The config of one model shard's part of the model."""
  m = model_shards
  return dataclasses.replace(config, num_heads=config.num_heads // m,
                             num_kv_heads=config.num_kv_heads // m,
                             intermediate_size=config.intermediate_size // m)


def _local_graphdef(lm, module: type, model_shards: int):
  """The graph of one model shard's part of ``lm``, a ``module`` (its Flax class)."""
  config = local_config(lm.config, model_shards)
  abstract = nnx.eval_shape(lambda: module(config, dtype=lm.dtype, rngs=nnx.Rngs(0),
                                           scan_layers=lm.scan_layers))
  return nnx.split(abstract)[0]


def _column_order(parts: tuple[int, ...], shards: int) -> np.ndarray:
  """Indices that regroup side-by-side parts (sizes ``parts``) into one block per shard,
  each block holding its share of every part in order."""
  starts = np.cumsum((0,) + parts[:-1])
  return np.concatenate([
      start + np.arange(s * size // shards, (s + 1) * size // shards)
      for s in range(shards) for start, size in zip(starts, parts)])


def _shard_params(lm, rules, mesh: Mesh):
  """``lm``'s weights as global arrays split over the model axis as ``rules`` say (the
  model's ``kvjax.models.config.ShardingRules``)."""
  c = lm.config
  m = mesh_sizes(mesh)[1]
  qkv = tuple(n * c.head_dim for n in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
  orders = {name: _column_order(qkv, m) for name in rules.head_columns}
  orders.update({name: _column_order((c.intermediate_size,) * 2, m)
                 for name in rules.mlp_columns})

  def place(path, x):
    name = _param_name(path)
    host = np.asarray(x)
    spec = [None] * host.ndim
    if name in orders:
      host, spec[-1] = np.take(host, orders[name], axis=-1), MODEL
    elif name in rules.row_split:
      spec[-2] = MODEL
    return put(host, sharding(mesh, P(*spec)))

  return jax.tree_util.tree_map_with_path(place, lm.params)


def _param_name(path) -> str:
  """The module attribute a parameter leaf belongs to ("wqkv", "scale", ...)."""
  names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)
           and isinstance(k.key, str)]
  return names[-1] if names else ""


def param_specs(params) -> Any:
  """The PartitionSpec of every leaf of sharded ``params`` (``shard_model``)."""
  return jax.tree.map(lambda x: x.sharding.spec, params)


# ------------------------------------------------------------------- the cache

def local_capacity(capacity, model_shards: int) -> tuple[tuple[int, ...], ...]:
  """[L][K / M] capacity of each model shard's heads; they must be the same on every shard."""
  local = []
  for l, row in enumerate(capacity):
    k = len(row) // model_shards
    blocks = {row[s * k:(s + 1) * k] for s in range(model_shards)}
    if len(blocks) > 1:
      raise ValueError(
          f"the capacities of layer {l}, {row}, differ between model shards; on a mesh "
          f"every model shard's KV heads need the same capacities")
    local.append(row[:k])
  return tuple(local)


def empty_cache(mesh: Mesh, *, batch_size: int, capacity, num_layers: int, num_kv_heads: int,
                head_dim: int, page_size: int = 16, dtype=jnp.float32,
                windows=None, num_pages: int | None = None) -> PagedKVCache:
  """An empty PagedKVCache laid over ``mesh`` (arguments as ``PagedKVCache.create``).

  Each device's block of the pool holds exactly the pages of its B / D
  sequences and K / M KV heads, so the KV bytes per device are the total
  over D * M. ``num_pages`` (a serving pool's, shared by the sequences) is
  the pages in all, cut into D * M equal blocks.
  """
  d, m = mesh_sizes(mesh)
  for what, size, shards in (("batch", batch_size, d), ("KV heads", num_kv_heads, m)):
    if size % shards:
      raise ValueError(f"{shards} shards must divide the {what}, {size}")
  if num_pages is not None and num_pages % (d * m):
    raise ValueError(f"the {d * m} devices must divide the pool's {num_pages} pages")
  cap = _capacity_table(capacity, num_layers, num_kv_heads)
  create_local = functools.partial(
      PagedKVCache.create, batch_size=batch_size // d, capacity=local_capacity(cap, m),
      num_layers=num_layers, num_kv_heads=num_kv_heads // m, head_dim=head_dim,
      page_size=page_size, dtype=dtype, windows=windows,
      num_pages=None if num_pages is None else num_pages // (d * m))
  windows = jax.eval_shape(create_local).windows  # checks the arguments, allocates nothing

  def arrays():
    # Every device's block starts as the same empty cache of its sequences and heads.
    local = create_local()
    tile = lambda x, reps: jnp.tile(x, reps + (1,) * (x.ndim - len(reps)))
    return dict({n: tile(getattr(local, n), (d * m,)) for n in _POOL_FIELDS},
                page_table=tile(local.page_table, (d, 1, m)),
                lengths=tile(local.lengths, (d, 1, m)),
                num_free=tile(local.num_free[None], (d * m,)))

  specs = _cache_field_specs()
  made = jax.jit(arrays, out_shardings={k: sharding(mesh, s) for k, s in specs.items()})()
  return PagedKVCache(**made, page_size=page_size, capacity=cap, shards=(d, m), windows=windows)


def _cache_field_specs() -> dict[str, P]:
  return dict(dict.fromkeys(_POOL_FIELDS + ("num_free",), _POOL),
              page_table=SPECS["heads"], lengths=SPECS["heads"])


def cache_specs(cache: PagedKVCache) -> PagedKVCache:
  """``cache`` with each array replaced by its PartitionSpec (a spec tree for shard_map)."""
  return cache.replace(**_cache_field_specs())


def to_local(cache: PagedKVCache) -> PagedKVCache:
  """Inside a per-device program: the device's block of a mesh cache, as a plain cache."""
  return cache.replace(num_free=cache.num_free[0],
                       capacity=local_capacity(cache.capacity, cache.shards[1]), shards=(1, 1))


def to_global(local: PagedKVCache, like: PagedKVCache) -> PagedKVCache:
  """Inverse of ``to_local``: the block as its part of a cache shaped like ``like``."""
  return local.replace(num_free=local.num_free[None], capacity=like.capacity,
                       shards=like.shards)


def zeros(mesh: Mesh, shape: tuple[int, ...], dtype, kind: str) -> jax.Array:
  """A zero array laid out as ``kind`` (``SPECS``), made on the devices themselves."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding(mesh, SPECS[kind]))()


def put(x, target: NamedSharding) -> jax.Array:
  """``x`` (a host value or array) as a global array with sharding ``target``.

  Works with several processes as long as each holds the whole value: a host
  value is cut on each process into its own devices' parts.
  """
  if isinstance(x, jax.Array):
    if x.sharding == target:
      return x
    if len(x.sharding.device_set) > 1 or not x.is_fully_addressable:
      return jax.device_put(x, target)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, target, lambda index: host[index])
