"""Running kvjax on a mesh of devices, across one or several processes.

  mesh = kvjax.sharding.make_mesh("data:2,model:4")
  result = kvjax.generate(lm, prompts, policy="snapkv", budget=256, mesh=mesh)

Sequences split over the ``data`` axis; KV heads, with their query heads and
the MLP's columns, over the ``model`` axis (tensor parallel). Each device
holds the pages of its own sequences and heads: the KV bytes per device are
the total over the mesh's size. ``layout`` says where every array lives,
``programs`` how generate's programs run per device, ``collectives`` the
reductions that cross devices. Several processes join one mesh through
``jax.distributed.initialize`` (docs/sharding.md).

Names load on first use: the models and policies import ``collectives``
alone.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "DATA": "kvjax.sharding.mesh",
    "MODEL": "kvjax.sharding.mesh",
    "make_mesh": "kvjax.sharding.mesh",
    "check_mesh": "kvjax.sharding.mesh",
    "empty_cache": "kvjax.sharding.layout",
    "shard_model": "kvjax.sharding.layout",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
  if name not in _NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_NAMES[name]), name)
  globals()[name] = value
  return value
