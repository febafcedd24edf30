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

from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.sharding import layout
from kvjax.sharding.mesh import DATA, MODEL

# Results that leave for the host (generated tokens): per sequence on the
# devices, gathered whole to every process (small: [B, max_new_tokens]).
TO_HOST = "to_host"


def _spec(kind: str, value, like=None):
  """shard_map's spec (a prefix of ``value``'s tree) for an array of ``kind``;
  a result cache (``value`` None) is shaped like the argument cache ``like``."""
  if kind == "params":
    return layout.param_specs(value)
  if kind == "cache":
    return layout.cache_specs(like if value is None else value)
  return layout.SPECS["batch" if kind == TO_HOST else kind]


def _sharding(mesh: Mesh, kind: str, spec):
  """jit's sharding for ``spec``; ``TO_HOST`` results replicated."""
  spec = layout.SPECS["replicated"] if kind == TO_HOST else spec
  return jax.tree.map(lambda p: layout.sharding(mesh, p), spec,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


class MeshProgram:
  """A compiled per-device program; calling it lays its arguments out on the mesh first."""

  def __init__(self, compiled: jax.stages.Compiled, in_shardings: tuple):
    self.compiled = compiled
    self.in_shardings = in_shardings

  def __call__(self, *args):
    placed = jax.tree.map(
        lambda target, value: jax.tree.map(lambda x: layout.put(x, target), value),
        self.in_shardings, args, is_leaf=lambda x: isinstance(x, NamedSharding))
    return self.compiled(*placed)

  def __getattr__(self, name):  # out_info, memory_analysis, as_text, ...
    return getattr(self.compiled, name)


def compile(fn: Callable, args: tuple, statics: dict, mesh: Mesh, kinds: tuple,
            compile_lowered: Callable) -> MeshProgram:
  """Compiles ``fn(*args, **statics)`` to run per device on ``mesh``.

  Args:
    args: the arguments (arrays or ``jax.ShapeDtypeStruct``); a cache among
      them is a mesh cache (``layout.empty_cache``).
    kinds: (argument kinds, result kinds) of ``fn``; result kinds a tuple, or
      one kind for a program that returns one value.
    compile_lowered: ``lowered -> compiled`` (kvjax.generation.compile's).
  """
  in_kinds, out_kinds = kinds
  single = isinstance(out_kinds, str)
  out_kinds = (out_kinds,) if single else out_kinds
  one = (lambda results: results[0]) if single else (lambda results: results)
  like = next((a for k, a in zip(in_kinds, args) if k == "cache"), None)
  in_specs = tuple(_spec(k, a) for k, a in zip(in_kinds, args))
  out_specs = tuple(_spec(k, None, like) for k in out_kinds)

  # Per device, the program's reductions span the mesh's axes.
  statics = dict(statics, ex=statics["ex"].on_mesh(DATA, MODEL))

  def per_device(*local_args):
    local_args = [layout.to_local(a) if k == "cache" else a for k, a in zip(in_kinds, local_args)]
    results = fn(*local_args, **statics)
    results = (results,) if single else results
    return one(tuple(layout.to_global(r, like) if k == "cache" else r
                     for k, r in zip(out_kinds, results)))

  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=one(out_specs),
                         check_vma=False)
  in_shardings = tuple(_sharding(mesh, k, s) for k, s in zip(in_kinds, in_specs))
  out_shardings = one(tuple(_sharding(mesh, k, s) for k, s in zip(out_kinds, out_specs)))
  jitted = jax.jit(mapped, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=(1,))
  return MeshProgram(compile_lowered(jitted.lower(*args)), in_shardings)
