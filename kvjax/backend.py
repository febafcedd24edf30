"""The one switch between Pallas kernels and their XLA (jnp) references.

``"auto"`` picks Pallas on GPU/TPU when a Pallas kernel is registered and the
XLA reference elsewhere; ``"xla"`` and ``"pallas"`` force one side.
"""

from __future__ import annotations

from typing import Callable

import jax

from kvjax.kernels import paged_attention as paged_attention_lib

BACKENDS = ("auto", "xla", "pallas")

# name -> implementation; Pallas kernels register themselves here.
_PAGED_ATTENTION: dict[str, Callable] = {
    "xla": paged_attention_lib.paged_attention_reference,
}


def register_paged_attention(backend: str, fn: Callable) -> None:
  """Registers an implementation of paged decode attention for a backend."""
  _PAGED_ATTENTION[backend] = fn


def resolve(backend: str) -> str:
  """Maps "auto" to a concrete backend; validates the name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    return "pallas" if on_accelerator and "pallas" in _PAGED_ATTENTION else "xla"
  if backend not in _PAGED_ATTENTION:
    raise ValueError(
        f"backend {backend!r} has no paged attention implementation in this "
        f"build; available: {sorted(_PAGED_ATTENTION)}")
  return backend


def paged_attention_fn(backend: str) -> Callable:
  """The paged decode attention of a backend (signature of the reference)."""
  return _PAGED_ATTENTION[resolve(backend)]
