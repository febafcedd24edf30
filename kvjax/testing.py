"""Test helpers shared by kvjax's tests and by users testing their own models.

Tolerances live in one table keyed by dtype; comparisons run in float32 on
valid positions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

# dtype -> tolerances for kernel/reference comparisons.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=2e-3, rtol=2e-3),
}


def tolerance(dtype) -> dict:
  """atol/rtol for comparing arrays computed in ``dtype``."""
  return TOLERANCES[jnp.dtype(dtype)]


def assert_close(actual, desired, dtype=jnp.float32, mask=None, **overrides) -> None:
  """Compares in float32, where ``mask`` (broadcastable) is true, with the dtype's tolerance."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  d = np.asarray(jnp.asarray(desired, jnp.float32))
  if mask is not None:
    m = np.broadcast_to(np.asarray(mask, bool), a.shape)
    a, d = a[m], d[m]
  np.testing.assert_allclose(a, d, **{**tolerance(dtype), **overrides})


@contextlib.contextmanager
def count_compilations():
  """Counts XLA backend compilations inside the block: ``with ... as n: ...; n[0]``."""
  count = [0]

  def listener(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield count
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def assert_cache_consistent(cache) -> None:
  """Checks the page accounting of a PagedKVCache; AssertionError names the first fault.

  What must hold after any sequence of cache operations:
    - every page id in [0, P) is either on the free stack or in exactly one
      page-table entry: never both, never twice, never neither (no page shared
      by two (sequence, layer, KV head), none lost);
    - each head's pages fill its page-table row from the front, within its
      capacity (``capacity // page_size`` pages at most);
    - 0 <= length <= capacity, and the head's pages cover its length;
    - free pages, and the slots of owned pages at or past a head's length,
      hold no entry: position -1 and score 0 (a token appended there starts
      from that score, unwritten).

  Works on host copies, so call it outside jit (tests, debugging).
  """
  table = np.asarray(cache.page_table)  # [B, L, K, P_max]
  lengths = np.asarray(cache.lengths)  # [B, L, K]
  positions = np.asarray(cache.positions)  # [P, S_page]
  scores = np.asarray(cache.scores)
  num_free = int(cache.num_free)
  num_pages, ps = cache.num_pages, cache.page_size
  if not 0 <= num_free <= num_pages:
    raise AssertionError(f"num_free {num_free} outside [0, {num_pages}]")
  free = np.asarray(cache.free_pages)[:num_free]
  owned = table[table >= 0]
  for name, ids in (("free stack", free), ("page table", owned)):
    bad = ids[(ids < 0) | (ids >= num_pages)]
    if bad.size:
      raise AssertionError(f"{name} holds page ids outside [0, {num_pages}): {bad.tolist()}")
    ids_, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
      raise AssertionError(f"{name} holds page(s) {ids_[counts > 1].tolist()} more than once")
  both = np.intersect1d(free, owned)
  if both.size:
    raise AssertionError(f"page(s) {both.tolist()} are both free and owned")
  if owned.size + free.size != num_pages:
    lost = np.setdiff1d(np.arange(num_pages), np.concatenate([free, owned]))
    raise AssertionError(f"{owned.size} owned + {free.size} free != {num_pages} pages; "
                         f"lost: {lost.tolist()}")
  cap = np.asarray(cache.capacity, np.int64)[None]  # [1, L, K]
  have = (table >= 0).sum(-1)
  prefix = np.arange(table.shape[-1]) < have[..., None]
  for what, bad in (
      ("pages not allocated front to back", (prefix != (table >= 0)).any(-1)),
      ("more pages than its capacity", have * ps > cap),
      ("length outside [0, capacity]", (lengths < 0) | (lengths > cap)),
      ("length past its pages", lengths > have * ps)):
    if bad.any():
      raise AssertionError(f"head(s) (sequence, layer, KV head) {np.argwhere(bad).tolist()} "
                           f"have {what}")
  slot = np.arange(table.shape[-1] * ps)
  per_head = positions[np.maximum(table, 0)].reshape(*table.shape[:3], -1)  # [B, L, K, S]
  past = (slot >= lengths[..., None]) & np.repeat(table >= 0, ps, -1)
  head_scores = scores[np.maximum(table, 0)].reshape(per_head.shape)
  for what, stale in (("positions", past & (per_head != -1)),
                      ("scores", past & (head_scores != 0))):
    if stale.any():
      raise AssertionError(f"slots (sequence, layer, KV head, slot) "
                           f"{np.argwhere(stale).tolist()} past their head's length hold {what}")
  if free.size and ((positions[free] != -1).any() or (scores[free] != 0).any()):
    raise AssertionError("a free page still holds an entry (position or score)")


def run_under_sanitizers(harness, sanitizers: str):
  """Builds a C++ check of the native kernels with ``-fsanitize=sanitizers`` and runs it.

  ``harness`` is a .cc file that includes a kernel source (found beside
  kvjax.kernels.native) and exits 0 when its cases pass; the build stops at
  the first sanitizer report (-fno-sanitize-recover). Returns the run's
  CompletedProcess (text output).
  """
  import pathlib
  import subprocess
  import tempfile
  from kvjax.kernels import native
  with tempfile.TemporaryDirectory() as tmp:
    exe = pathlib.Path(tmp) / "check"
    subprocess.run([native.compiler(), "-std=c++17", "-O1", "-g", "-fopenmp-simd", "-w",
                    f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-pthread",
                    "-I", jax.ffi.include_dir(), "-I", str(native.SOURCES[0].parent),
                    str(harness), "-o", str(exe)], check=True, capture_output=True, timeout=600)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)


def policy_for(name: str, config, folder: str | pathlib.Path, delimiter_ids=(5, 6, 7)):
  """Policy ``name`` with what it needs to run on a model of ``config``: ``delimiter_ids``
  for the policies that cut at delimiters, and for ``duo`` gates of the model's shape
  (decreasing; one row per global layer) written to ``folder``/gates."""
  from kvjax import policies  # pylint: disable=g-import-not-at-top
  if name == "duo":
    from kvjax.retrieval_heads import save_gates  # pylint: disable=g-import-not-at-top
    shape = (len(config.global_layers), config.num_kv_heads)
    gates = np.linspace(1.0, 0.0, np.prod(shape), dtype=np.float32).reshape(shape)
    path = pathlib.Path(folder) / "gates"
    save_gates(path, gates, model=config.name, n_sink=4, recent=60, steps=1, losses=[0.0])
    return policies.get(name, gates=str(path))
  fields = {f.name for f in dataclasses.fields(type(policies.get(name)))}
  return policies.get(name, **({"delimiter_ids": tuple(delimiter_ids)}
                               if "delimiter_ids" in fields else {}))


def layout_for(policy, budget, prompt_len: int, *, num_layers: int = 1, num_kv_heads: int = 1,
               page_size: int | None = None, max_new_tokens: int = 0):
  """``policy``'s layout for a unit test: every layer global, nothing appended after the
  prompt unless ``max_new_tokens``; pages of one slot (PagedEviction: its own size)."""
  if page_size is None:
    page_size = getattr(policy, "page_size", 1)
  return policy.layout(budget, prompt_len=prompt_len, extra_tokens=0,
                       max_new_tokens=max_new_tokens, page_size=page_size,
                       num_kv_heads=num_kv_heads, windows=(0,) * num_layers)
