"""A PagedKVCache on disk: one orbax checkpoint folder, its arrays and what they mean.

A folder holds two orbax items (``orbax.checkpoint.CompositeCheckpointHandler``):

  cache     every array of the cache's pytree, as saved (numpy, the cache's dtypes):
              k_pages, v_pages [P, S_page, H]; positions, scores [P, S_page];
              page_table [B, L, K, P_max]; lengths [B, L, K]; free_pages [P];
              num_free []
  metadata  JSON: ``kind`` and ``format`` (what the folder is), the static
            fields (page_size, capacity [L][K], shards, windows [L]), each array's shape,
            dtype and CRC-32, and the caller's own metadata (``extra``)

Loading checks all of it, so a folder cut short, a file damaged or a folder
of something else fails with a ValueError naming the folder, not with a
cache that answers wrongly. This module knows no model and no policy:
``kvjax.save_cache`` records those in ``extra``.

Dimension letters: B batch, L layers, K KV heads, H head dim, P pages,
S_page slots per page.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import PagedKVCache, check_windows

KIND = "kvjax.PagedKVCache"
FORMAT = 1  # bump when what is saved changes
ARRAYS = ("k_pages", "v_pages", "positions", "scores", "page_table", "lengths", "free_pages",
          "num_free")


def checkpointer():
  """(orbax.checkpoint, a checkpointer of composite items): orbax loads on first use."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def restore_items(path: pathlib.Path, corrupt: str, **items: str) -> dict:
  """The composite items of the orbax folder ``path``, each "array" or "json".

  Raises:
    ValueError: ``corrupt`` and the cause, where orbax cannot read them (orbax
      and tensorstore raise many types for files missing or cut short).
  """
  ocp, reader = checkpointer()
  kinds = {"array": ocp.args.StandardRestore, "json": ocp.args.JsonRestore}
  try:
    with reader:
      return reader.restore(path, args=ocp.args.Composite(
          **{name: kinds[kind]() for name, kind in items.items()}))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{corrupt}: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e


def _crc32(array: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def save(path: str | os.PathLike, cache: PagedKVCache, *, extra: dict[str, Any] | None = None,
         overwrite: bool = False) -> pathlib.Path:
  """Writes ``cache`` (every array and static field) and ``extra`` to the orbax folder ``path``.

  Args:
    cache: a PagedKVCache on one device (``shards`` (1, 1)).
    extra: JSON values to keep beside the cache (``load`` returns them).
    overwrite: replace a cache already saved at ``path``. Never replaces
      anything else: a folder that is not a saved cache is left alone. The new
      cache is written beside it first and renamed over it only once whole, so
      a write that fails (a full disk) leaves the old one loadable.

  Returns:
    The folder, absolute.

  Raises:
    ValueError: a cache laid over a device mesh, ``path`` taken (by a saved
      cache without ``overwrite``, or by anything else), or ``extra`` not JSON.
  """
  path = pathlib.Path(path).expanduser().absolute()
  if not isinstance(cache, PagedKVCache):
    raise ValueError(f"save takes a PagedKVCache, got {type(cache).__name__}")
  if tuple(cache.shards) != (1, 1):
    raise ValueError(f"cannot save a cache laid over a device mesh (shards {cache.shards}) to "
                     f"{path}: its page ids are per device; save a single-device cache")
  if path.exists():
    if not overwrite:
      raise ValueError(f"{path} already exists; pass overwrite=True to replace a saved cache")
    if not path.is_dir() or (any(path.iterdir()) and not _is_saved_cache(path)):
      raise ValueError(f"{path} exists and is not a saved KV cache: not replacing it")
  arrays = {name: np.asarray(getattr(cache, name)) for name in ARRAYS}
  metadata = dict(
      kind=KIND, format=FORMAT, page_size=int(cache.page_size),
      capacity=[list(map(int, row)) for row in cache.capacity], shards=[1, 1],
      windows=list(map(int, cache.windows)),
      arrays={name: dict(shape=list(a.shape), dtype=str(a.dtype), crc32=_crc32(a))
              for name, a in arrays.items()},
      extra=dict(extra or {}))
  path.parent.mkdir(parents=True, exist_ok=True)
  staging = path.with_name(f".{path.name}.saving-{os.getpid()}")
  shutil.rmtree(staging, ignore_errors=True)
  ocp, writer = checkpointer()
  try:
    with writer:
      writer.save(staging, args=ocp.args.Composite(
          cache=ocp.args.StandardSave(arrays), metadata=ocp.args.JsonSave(metadata)),
                        force=True)
  except TypeError as e:  # json's message for a value it cannot write
    shutil.rmtree(staging, ignore_errors=True)
    raise ValueError(f"cannot save to {path}: extra metadata is not JSON: {e}") from e
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  _replace(staging, path)
  return path


def _replace(staging: pathlib.Path, path: pathlib.Path) -> None:
  """Puts the written folder ``staging`` at ``path``, the old one (if any) removed after.
  A crash between the two renames leaves the old cache at ``.NAME.old-PID`` beside it."""
  if not path.exists():
    os.rename(staging, path)
    return
  old = path.with_name(f".{path.name}.old-{os.getpid()}")
  shutil.rmtree(old, ignore_errors=True)
  os.rename(path, old)
  os.rename(staging, path)
  shutil.rmtree(old, ignore_errors=True)


def _is_saved_cache(path: pathlib.Path) -> bool:
  try:
    return read_metadata(path).get("kind") == KIND
  except ValueError:
    return False


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The metadata item of the saved cache in ``path`` (the arrays are not read).

  Raises:
    ValueError: no such folder, a folder that is not a saved cache, or a
      metadata item that cannot be read (truncated or corrupt).
  """
  path = pathlib.Path(path).expanduser().absolute()
  if not path.exists():
    raise ValueError(f"no saved KV cache at {path}: it does not exist")
  if not path.is_dir():
    raise ValueError(f"{path} is a file, not a saved KV cache (an orbax checkpoint folder)")
  if not (path / "metadata").exists():
    if (path / "cache").exists():
      raise ValueError(f"{path} is not a complete saved KV cache (truncated or corrupt): "
                       "its metadata item is missing")
    raise ValueError(f"{path} is not a saved KV cache: it holds no 'cache' and 'metadata' "
                     f"items (it holds {sorted(p.name for p in path.iterdir())[:8]})")
  metadata = restore_items(path, f"{_INCOMPLETE.format(path=path)}: its metadata cannot be read",
                           metadata="json")["metadata"]
  if not isinstance(metadata, dict) or metadata.get("kind") != KIND:
    raise ValueError(f"{path} is not a saved KV cache: its metadata is not kvjax's "
                     f"(kind {metadata.get('kind') if isinstance(metadata, dict) else None!r})")
  if not isinstance(metadata.get("format"), int) or metadata["format"] > FORMAT:
    raise ValueError(f"{path} was saved in format {metadata.get('format')!r}; this kvjax reads "
                     f"format {FORMAT} and older: upgrade kvjax")
  return dict(metadata)


def load(path: str | os.PathLike) -> tuple[PagedKVCache, dict[str, Any]]:
  """The cache saved by ``save`` in ``path`` (on the default device), and its ``extra``.

  Raises:
    ValueError: no such folder, a folder that is not a saved cache, or one
      that is truncated or corrupt (missing or damaged files, arrays whose
      shape, dtype or checksum disagree with the metadata).
  """
  path = pathlib.Path(path).expanduser().absolute()
  metadata = read_metadata(path)
  if not (path / "cache").exists():
    raise ValueError(f"{path} is not a complete saved KV cache (truncated or corrupt): its "
                     "cache item is missing")
  arrays = restore_items(path, f"{_INCOMPLETE.format(path=path)}: its arrays cannot be read",
                         cache="array")["cache"]
  arrays = {name: np.asarray(a) for name, a in dict(arrays).items()}
  try:
    specs = metadata["arrays"]
    if sorted(arrays) != sorted(ARRAYS) or sorted(specs) != sorted(ARRAYS):
      raise ValueError(f"arrays {sorted(arrays)}, expected {sorted(ARRAYS)}")
    for name in ARRAYS:
      a, spec = arrays[name], specs[name]
      if list(a.shape) != spec["shape"] or str(a.dtype) != spec["dtype"]:
        raise ValueError(f"{name} is {a.dtype}{list(a.shape)}, the metadata says "
                         f"{spec['dtype']}{spec['shape']}")
      if _crc32(a) != spec["crc32"]:
        raise ValueError(f"{name}'s checksum differs from the one saved")
    capacity = tuple(tuple(int(c) for c in row) for row in metadata["capacity"])
    page_size = int(metadata["page_size"])
    b, l, k, p_max = arrays["page_table"].shape
    if (len(capacity), len({len(row) for row in capacity}), len(capacity[0])) != (l, 1, k) or \
        max(c for row in capacity for c in row) != p_max * page_size or \
        arrays["k_pages"].shape[1] != page_size:
      raise ValueError(f"capacity {[list(r) for r in capacity]} and page size {page_size} "
                       f"disagree with a page table of shape {[b, l, k, p_max]}")
    windows = check_windows(metadata.get("windows"), capacity, page_size)
  except (KeyError, TypeError, IndexError, ValueError) as e:
    raise _corrupt(path, "its arrays disagree with its metadata", e) from e
  cache = PagedKVCache(**{name: jnp.asarray(arrays[name]) for name in ARRAYS},
                       page_size=page_size, capacity=capacity, windows=windows)
  return cache, dict(metadata.get("extra") or {})


_INCOMPLETE = "{path} is not a complete saved KV cache (truncated or corrupt)"


def _corrupt(path: pathlib.Path, what: str, error: Exception) -> ValueError:
  return ValueError(f"{_INCOMPLETE.format(path=path)}: {what}: "
                    f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
