"""Test helpers shared by kvjax's tests and by users testing their own models.

Tolerances live in one table keyed by dtype; comparisons run in float32 on
valid positions only.
"""

from __future__ import annotations

import contextlib

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
