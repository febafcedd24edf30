"""generate's programs on a mesh: each runs per device under ``jax.shard_map``.

XLA does not partition a Pallas (Mosaic or Triton) call, nor the page
tables' gathers and scatters into a pool it cannot see is split by head, so
the whole program body runs per device, on local shapes, exactly the code a
single device runs. The model's partial products meet in an all-reduce over
the model axis, and the few reductions over every sequence or KV head go
through ``kvjax.sharding.collectives``; nothing cache-sized crosses devices.

A program says what each of its arguments and results is ("params",
"cache", or a ``layout.SPECS`` kind); ``compile`` turns that into
shard_map's specs and jit's shardings.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from kvjax.cache.paged import PagedKVCache
from kvjax.sharding import collectives
from kvjax.sharding import layout
from kvjax.sharding.mesh import DATA, MODEL

# Results that leave for the host (generated tokens): per sequence on the
# devices, gathered whole to every process (small: [B, max_new_tokens]).
TO_HOST = "to_host"


def _specs(kinds, values) -> Any:
  """shard_map specs for ``values`` (a tuple, or one value for a single kind)."""
  if isinstance(kinds, str):
    return _spec(kinds, values)
  return tuple(_spec(k, v) for k, v in zip(kinds, values))


def _spec(kind: str, value):
  if kind == "params":
    return layout.param_specs(value)
  if kind == "cache":
    return layout.cache_specs(value)
  return layout.SPECS["batch" if kind == TO_HOST else kind]


def _shardings(mesh: Mesh, kinds, specs) -> Any:
  """jit's shardings for specs; ``TO_HOST`` results replicated."""
  named = lambda s: jax.tree.map(lambda p: layout.sharding(mesh, p), s,
                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  if isinstance(kinds, str):
    return named(layout.SPECS["replicated"] if kinds == TO_HOST else specs)
  return tuple(named(layout.SPECS["replicated"]) if k == TO_HOST else named(s)
               for k, s in zip(kinds, specs))


def _map_caches(kinds, values, fn) -> Any:
  if isinstance(kinds, str):
    return fn(values) if kinds == "cache" else values
  return tuple(fn(v) if k == "cache" else v for k, v in zip(kinds, values))


class MeshProgram:
  """A compiled per-device program; calling it lays its arguments out on the mesh first."""

  def __init__(self, compiled: jax.stages.Compiled, in_shardings):
    self.compiled = compiled
    self.in_shardings = in_shardings

  def __call__(self, *args):
    placed = jax.tree.map(
        lambda target, value: jax.tree.map(lambda x: layout.put(x, target), value),
        tuple(self.in_shardings), args,
        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    return self.compiled(*placed)

  def __getattr__(self, name):  # out_info, memory_analysis, as_text, ...
    return getattr(self.compiled, name)


def compile(fn: Callable, args: tuple, statics: dict, mesh: Mesh, kinds: tuple,
            compile_lowered: Callable) -> MeshProgram:
  """Compiles ``fn(*args, **statics)`` to run per device on ``mesh``.

  Args:
    args: the arguments (arrays or ``jax.ShapeDtypeStruct``); a cache among
      them is a mesh cache (``layout.empty_cache``).
    kinds: (argument kinds, result kinds) of ``fn``.
    compile_lowered: ``lowered -> compiled`` (kvjax.generation.compile's).
  """
  in_kinds, out_kinds = kinds
  in_specs = _specs(in_kinds, args)
  caches = [a for k, a in zip(in_kinds, args) if k == "cache"]
  like = caches[0] if caches else None

  def per_device(*local_args):
    local_args = _map_caches(in_kinds, local_args, layout.to_local)
    with collectives.on_axes(DATA, MODEL):
      out = fn(*local_args, **statics)
    return _map_caches(out_kinds, out, lambda c: layout.to_global(c, like))

  out_specs = _out_specs(out_kinds, like)
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  in_shardings = _shardings(mesh, in_kinds, in_specs)
  jitted = jax.jit(mapped, in_shardings=in_shardings,
                   out_shardings=_shardings(mesh, out_kinds, out_specs), donate_argnums=(1,))
  return MeshProgram(compile_lowered(jitted.lower(*args)), in_shardings)


def _out_specs(out_kinds, like: PagedKVCache | None):
  """Result specs: a result cache is shaped like the argument cache."""
  spec = lambda k: layout.cache_specs(like) if k == "cache" else _spec(k, None)
  if isinstance(out_kinds, str):
    return spec(out_kinds)
  return tuple(spec(k) for k in out_kinds)
