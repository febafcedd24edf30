"""Keeping the host process's resident set down: libc calls, used where they pay.

A CPU run's memory is the process's resident set, and three things kept it
higher than what is alive: pages glibc keeps after a free (compilation, a
model load, a program's scratch), the pages of a memory-mapped file once
read, and the small programs that eager array conversions compile. Each libc
helper does nothing where its call is missing (not glibc, not Linux or macOS).
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import jax
import numpy as np


@functools.cache
def _libc() -> ctypes.CDLL | None:
  """The C library this process runs on (looked up once), or None where there is none."""
  try:
    return ctypes.CDLL(None)
  except (OSError, TypeError):  # Windows: no handle for the process itself
    return None


def return_freed_memory() -> None:
  """Gives the heap that was freed back to the system (glibc's ``malloc_trim``).

  glibc keeps freed pages in its arenas, resident, under whatever runs next.
  XLA's CPU compiler frees most of what it allocates: compiling SmolLM2's
  chunked-prefill program left ~110 MiB resident, and an 8K chunked prefill
  peaked ~100 MiB higher for it; a model load leaves ~30 MiB of host copies.
  It costs milliseconds.
  """
  trim = getattr(_libc(), "malloc_trim", None)  # not glibc (macOS, musl): nothing to trim
  if trim is not None:
    trim(0)


# mallopt's parameter for the size from which malloc maps a block of its own (malloc.h).
_M_MMAP_THRESHOLD = -3


def map_large_blocks(threshold: int = 1 << 20) -> bool:
  """Gives blocks of ``threshold`` bytes and more pages of their own, returned on free.

  glibc maps a large block on its own, but raises that size (up to 32 MiB)
  each time such a block is freed, so a compiled program's scratch (26 MiB
  for SmolLM2's 512-token chunk program) soon comes from the heap arenas,
  which keep it resident after the free. A fixed threshold (glibc's
  ``M_MMAP_THRESHOLD``) keeps new large blocks in pages of their own, which go
  back to the system when freed: an 8K chunked prefill's peak resident set
  fell by ~25-30 MiB (SmolLM2 packed, budget 1024). Process-wide, so the
  command-line tools call it at start; a library user may call it too.

  Returns:
    Whether the threshold was set (False where there is no glibc ``mallopt``).
  """
  mallopt = getattr(_libc(), "mallopt", None)
  return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(threshold)))


# mallopt's parameter for the most heap arenas glibc creates (malloc.h).
_M_ARENA_MAX = -8


def single_arena() -> bool:
  """Makes every thread allocate from glibc's main heap arena.

  glibc gives each new thread that allocates an arena of its own (up to 8 per
  core), and blocks freed in one stay resident there, out of reach of the
  other threads; XLA's runtime threads each kept some. One arena: an 8K chunked
  prefill's peak resident set fell by ~12 MiB, a one-shot one's by ~3
  (SmolLM2 packed, budget 1024, 2-core CPU), at the same speed. Process-wide
  and for arenas not yet created: call it at start, as the command-line tools do.

  Returns:
    Whether the limit was set (False where there is no glibc ``mallopt``).
  """
  mallopt = getattr(_libc(), "mallopt", None)
  return bool(mallopt is not None and mallopt(_M_ARENA_MAX, 1))


def drop_file_pages(view: np.ndarray, file_map: np.ndarray) -> None:
  """Takes the pages under ``view``, a part of the read-only file map ``file_map``, out of RSS.

  For a view whose data has been copied out. Every page of a map that was read
  stays resident until the map goes: a GGUF load held the whole file (94 MiB
  for SmolLM2's Q4_1) on top of the weights copied from it. MADV_DONTNEED on
  a shared read-only file map only unmaps: the data stays in the page cache
  and a later read of the view faults it back in. A view outside the map (a
  copy) is left alone: dropping anonymous pages would zero them.
  """
  start = view.__array_interface__["data"][0]
  first = file_map.__array_interface__["data"][0]
  if not first <= start <= start + view.nbytes <= first + file_map.nbytes:
    return
  madvise, dontneed = getattr(_libc(), "madvise", None), getattr(mmap, "MADV_DONTNEED", None)
  if madvise is None or dontneed is None:  # Windows
    return
  begin = start - start % mmap.PAGESIZE
  madvise(ctypes.c_void_p(begin), ctypes.c_size_t(start + view.nbytes - begin), dontneed)


def to_device(x, dtype=None) -> jax.Array:
  """A host value (array, list, scalar) as a device array, without compiling a program.

  ``jnp.asarray`` of a NumPy array compiles a program per shape and dtype
  (it lifts the value with ``lax.stage``), and on a CPU each compiled program
  holds ~1.5 MiB of host memory for the rest of the process; a generate call
  made ~20 of them. ``jax.device_put`` copies the value and compiles nothing.
  """
  return jax.device_put(np.asarray(x, dtype))
