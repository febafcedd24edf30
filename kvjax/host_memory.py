"""Keeping the host process's resident set down.

``to_device`` is for the library: host values reach the device without
compiling a program. The glibc settings (``map_large_blocks``,
``single_arena``) are process-wide: only the opt-in ``kvjax.runtime.setup()``
calls them, never a library path. Each does nothing where its call is missing
(not glibc).
"""

from __future__ import annotations

import ctypes
import functools

import jax
import numpy as np


@functools.cache
def _libc() -> ctypes.CDLL | None:
  """The C library this process runs on (looked up once), or None where there is none."""
  try:
    return ctypes.CDLL(None)
  except (OSError, TypeError):  # Windows: no handle for the process itself
    return None


def _mallopt(param: int, value: int) -> bool:
  """glibc's ``mallopt(param, value)``: whether it took (False where there is none)."""
  mallopt = getattr(_libc(), "mallopt", None)
  return bool(mallopt is not None and mallopt(param, value))


# mallopt's parameter for the size from which malloc maps a block of its own (malloc.h).
_M_MMAP_THRESHOLD = -3


def map_large_blocks(threshold: int = 1 << 20) -> bool:
  """Gives blocks of ``threshold`` bytes and more pages of their own, returned on free.

  glibc maps a large block on its own, but raises that size (up to 32 MiB)
  each time such a block is freed, so a compiled program's scratch (tens of
  MiB) soon comes from the heap arenas, which keep it resident after the free.
  A fixed threshold (glibc's ``M_MMAP_THRESHOLD``) keeps new large blocks in
  pages of their own, which go back to the system when freed (the effect on a
  chunked prefill's peak: docs/results/bench_prefill_8k.md). Process-wide:
  called by ``kvjax.runtime.setup()``.

  Returns:
    Whether the threshold was set (False where there is no glibc ``mallopt``).
  """
  return _mallopt(_M_MMAP_THRESHOLD, int(threshold))


# mallopt's parameter for the most heap arenas glibc creates (malloc.h).
_M_ARENA_MAX = -8


def single_arena() -> bool:
  """Makes every thread allocate from glibc's main heap arena.

  glibc gives each new thread that allocates an arena of its own (up to 8 per
  core), and blocks freed in one stay resident there, out of reach of the
  other threads; XLA's runtime threads each keep some. One arena holds less at
  the same speed (docs/results/bench_prefill_8k.md). Process-wide and for
  arenas not yet created: called by ``kvjax.runtime.setup()``, at start.

  Returns:
    Whether the limit was set (False where there is no glibc ``mallopt``).
  """
  return _mallopt(_M_ARENA_MAX, 1)


def to_device(x, dtype=None) -> jax.Array:
  """A host value (array, list, scalar) as a device array, without compiling a program.

  ``jnp.asarray`` of a NumPy array compiles a program per shape and dtype
  (it lifts the value with ``lax.stage``), and on a CPU each compiled program
  holds host memory for the rest of the process. ``jax.device_put`` copies the
  value and compiles nothing.
  """
  return jax.device_put(np.asarray(x, dtype))
