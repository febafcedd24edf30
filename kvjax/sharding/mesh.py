"""Device meshes for generate: sequences over a ``data`` axis, KV heads over a ``model`` axis."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA, MODEL = "data", "model"  # the mesh's axis names, in this order


def make_mesh(shape: str | Mapping[str, int] | Sequence[int] | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over ``devices`` (default: every device of every process).

  Args:
    shape: "data:2,model:4", {"data": 2, "model": 4} or (2, 4); an axis left
      out has size 1, and one size may be -1 (the devices left). None: every
      device on the data axis.
    devices: the devices, in mesh order (data-major).

  Raises:
    ValueError: an unknown axis, a size that is not a positive int, or sizes
      whose product is not the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = _parse(shape, len(devices))
  if sizes[0] * sizes[1] != len(devices):
    raise ValueError(f"a mesh of data:{sizes[0]},model:{sizes[1]} needs "
                     f"{sizes[0] * sizes[1]} devices, there are {len(devices)}")
  return Mesh(np.array(devices, dtype=object).reshape(sizes), (DATA, MODEL))


def _parse(shape, num_devices: int) -> tuple[int, int]:
  if shape is None:
    return num_devices, 1
  if isinstance(shape, str):
    sizes = {}
    for part in filter(None, (p.strip() for p in shape.split(","))):
      name, sep, value = part.partition(":")
      try:
        sizes[name.strip()] = int(value) if sep else None
      except ValueError:
        sizes[name.strip()] = value
    shape = sizes
  if isinstance(shape, Mapping):
    unknown = sorted(set(shape) - {DATA, MODEL})
    if unknown:
      raise ValueError(f"mesh axes are {DATA!r} and {MODEL!r}, got {unknown}")
    shape = (shape.get(DATA, 1), shape.get(MODEL, 1))
  shape = tuple(shape)
  if len(shape) != 2:
    raise ValueError(f"a mesh has two axes ({DATA}, {MODEL}), got {shape!r}")
  for name, size in zip((DATA, MODEL), shape):
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (
        size <= 0 and size != -1):
      raise ValueError(f"mesh axis {name!r} must be a positive int (or -1), got {size!r}")
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {shape!r}")
  if -1 in shape:
    known = shape[1 - shape.index(-1)]
    if num_devices % known:
      raise ValueError(f"{num_devices} devices do not divide into axes of {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return int(shape[0]), int(shape[1])


def mesh_sizes(mesh: Mesh | None) -> tuple[int, int]:
  """(data shards, model shards); (1, 1) for None."""
  if mesh is None:
    return 1, 1
  return mesh.shape[DATA], mesh.shape[MODEL]


def check_mesh(mesh, config, batch_size: int | None = None) -> None:
  """Raises ValueError unless ``mesh`` is a (data, model) mesh that splits this model and batch.

  The model axis must divide the KV heads (each shard owns whole heads and
  their query heads) and the MLP width; the data axis the batch.
  """
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
    names = getattr(mesh, "axis_names", None)
    raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ({DATA!r}, {MODEL!r}) "
                     f"(kvjax.sharding.make_mesh), got {type(mesh).__name__} with axes {names}")
  d, m = mesh_sizes(mesh)
  for what, size in (("KV heads", config.num_kv_heads),
                     ("MLP width (intermediate_size)", config.intermediate_size)):
    if size % m:
      raise ValueError(f"the model axis ({m} shards) must divide the model's {what}, "
                       f"{size}")
  if batch_size is not None and batch_size % d:
    raise ValueError(f"the data axis ({d} shards) must divide the batch of {batch_size} "
                     "prompts")
