"""The static shape of a paged cache, and the checks its methods run on their arguments.

Capacities, ring windows and page counts are Python ints fixed when a cache is
made (``kvjax.cache.paged``); these helpers normalise and validate them, and
``check_array`` rejects a wrong shape or dtype at trace time with a message
that names the argument, instead of a broadcasting error deep inside XLA.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

EMPTY = -1  # page id of an absent page, original position of an empty slot


def layer_window(windows: Sequence[int], layer) -> tuple[int, bool | jax.Array]:
  """(W, whether ``layer`` is local) from per-layer windows (0: global; () for
  none): a Python bool for an int layer, a traced one otherwise.

  Raises:
    ValueError: local layers of two window sizes.
  """
  sizes = {w for w in windows if w}
  if len(sizes) > 1:
    raise ValueError(f"local layers with different windows {sorted(sizes)} are not supported")
  if not sizes:
    return 0, False
  if isinstance(layer, (int, np.integer)):
    return max(sizes), bool(windows[layer])
  return max(sizes), jnp.asarray(windows)[layer] > 0


def check_windows(windows, capacity, page_size: int) -> tuple[int, ...]:
  """``windows`` (None or one int per layer) as ``PagedKVCache.windows``: () when no
  layer is a ring.

  Raises:
    ValueError: a window that is not a multiple of ``page_size``, rings of two
      sizes, or a ring layer whose capacity exceeds its window.
  """
  if windows is None or not any(windows):
    return ()
  windows = tuple(int(w) for w in windows)
  if len(windows) != len(capacity):
    raise ValueError(f"windows has {len(windows)} layers, the cache {len(capacity)}")
  sizes = sorted({w for w in windows if w})
  if len(sizes) > 1 or sizes[0] < 0 or sizes[0] % page_size:
    raise ValueError(f"ring layers need one window, a multiple of page_size {page_size}; "
                     f"got {sizes}")
  for l, (w, row) in enumerate(zip(windows, capacity)):
    if w and max(row) > w:
      raise ValueError(f"layer {l} is a ring of {w} slots: its capacity {max(row)} "
                       "must not exceed it")
  return windows


def check_layer(layer, num_layers: int) -> None:
  """A Python int layer must be in range; a traced one must be an integer scalar."""
  if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
    if not 0 <= layer < num_layers:
      raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    return
  check_array("layer", layer, "[]", (), "int")


def check_array(name: str, x, letters: str, shape: tuple, kind: str) -> None:
  """Raises ValueError unless ``x`` has ``shape`` (None: any size) and a dtype of ``kind``.

  Runs on shapes and dtypes only (static under jit), so it costs nothing per step.

  Args:
    name: the argument's name, for the message.
    letters: the shape in dimension letters, e.g. "[B, L, K]".
    shape: the expected sizes.
    kind: "int", "float" or "bool".
  """
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    x = np.asarray(x)  # Python scalars and lists
  got = tuple(x.shape)
  if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
    want = tuple("any" if w is None else w for w in shape)
    raise ValueError(f"{name} must have shape {letters} = {want}, got {got}")
  dtype = np.dtype(x.dtype)
  ok = {"int": jnp.issubdtype(dtype, jnp.integer),
        "float": jnp.issubdtype(dtype, jnp.floating),
        "bool": dtype == np.dtype(bool)}[kind]
  if not ok:
    article = "an" if kind == "int" else "a"
    raise ValueError(f"{name} must be {article} {kind} array, got dtype {dtype}")


def pages_owned(page_table: jax.Array) -> jax.Array:
  """[B, L, K] number of allocated pages (pages are allocated front to back)."""
  return (page_table >= 0).sum(axis=-1, dtype=jnp.int32)


def capacity_table(capacity, num_layers: int, num_kv_heads: int) -> tuple[tuple[int, ...], ...]:
  """Normalises an int, [L] or [L][K] capacity into an [L][K] tuple of ints."""
  if isinstance(capacity, (int, np.integer)):
    return tuple((int(capacity),) * num_kv_heads for _ in range(num_layers))
  rows = list(capacity)
  if len(rows) != num_layers:
    raise ValueError(f"capacity has {len(rows)} layers, the model has {num_layers}")
  table = []
  for l, row in enumerate(rows):
    if isinstance(row, (int, np.integer)):
      table.append((int(row),) * num_kv_heads)
    else:
      row = tuple(int(c) for c in row)
      if len(row) != num_kv_heads:
        raise ValueError(
            f"capacity of layer {l} has {len(row)} heads, the model has {num_kv_heads}")
      table.append(row)
  return tuple(table)


def round_up(n: int, multiple: int) -> int:
  return multiple * math.ceil(n / multiple)
