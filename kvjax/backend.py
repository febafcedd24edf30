"""The one switch between Pallas kernels and their XLA (jnp) references.

``"auto"`` picks Pallas on GPU/TPU when a Pallas kernel is registered and the
XLA reference elsewhere; ``"xla"`` and ``"pallas"`` force one side. A forced
``"pallas"`` on CPU runs the kernel in Pallas' interpreter (slow, but the same
kernel body), so CPU tests exercise it.
"""

from __future__ import annotations

from typing import Callable

import jax

# Names, not the module: kvjax.kernels re-exports the kernel function under the
# module's own name, so `from kvjax.kernels import paged_attention` is the function.
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference

BACKENDS = ("auto", "xla", "pallas")


def _interpret() -> bool:
  """Pallas kernels run in interpret mode on CPU, where nothing compiles them."""
  return jax.default_backend() == "cpu"


def _pallas_paged_attention(q, k_pages, v_pages, page_table, lengths, *, return_weights=False):
  """The Pallas kernel with the reference's signature (interpreted on CPU)."""
  return paged_attention(q, k_pages, v_pages, page_table, lengths,
                         return_weights=return_weights, interpret=_interpret())


# name -> implementation; Pallas kernels register themselves here.
_PAGED_ATTENTION: dict[str, Callable] = {
    "xla": paged_attention_reference,
}
_PAGED_ATTENTION["pallas"] = _pallas_paged_attention


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
