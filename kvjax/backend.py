"""The one switch between the kernels (Pallas, native C++) and their XLA (jnp) references.

Every kernel op has an ``"xla"`` implementation (its reference), most a
``"pallas"`` one, with one signature; paged decode attention, a prompt's
causal attention and the packed weights' products also have a ``"native"``
one for CPU (C++ through XLA's FFI, ``kvjax.kernels.native``, compiled on
first use into ``$KVJAX_CACHE_DIR/native``).

A program's ``kvjax.execution.Execution`` holds, per op, the implementation
``resolve`` chose for its backend and platform, and hands out each op's
implementation (``implementation``) while the program is traced.
``use(name)`` sets an ambient backend for a user's own code
(``kvjax.execution.ambient``, ``get``); the library's programs never read it.

  "auto"    per (platform, op), what a measurement showed fastest: this device
            kind's, written by ``python -m kvjax.bench --preset=accelerator``
            into the cache folder, else the committed table's
            (``kvjax.backend_choices``), XLA where nothing was measured; the
            CPU's native kernels only where they build (any failure to build
            or cache them, a compiler's or the cache folder's, warns once and
            leaves XLA; ``KVJAX_NATIVE=0`` keeps XLA too).
  "xla"     the references.
  "pallas"  the Pallas kernels, XLA for ops without one; on a CPU the kernel
            runs in Pallas' interpreter (slow, but the same kernel body), so
            CPU tests exercise it.
  "native"  the C++ kernels (CPU only), XLA for ops without one; raises
            ``NativeUnavailable`` with the reason where they do not build.

Ops (name: signature of the reference):
  paged_attention   kvjax.kernels.paged_attention.paged_attention_reference
  window_scores     kvjax.kernels.window_scoring.window_scores_reference
  token_norms       kvjax.kernels.window_scoring.token_norms_reference
  compact_slots     kvjax.kernels.compaction.compact_slots_reference
  segment_ids       kvjax.kernels.segmentation.segment_ids_checked
  dynamic_split     kvjax.kernels.segmentation.dynamic_split_checked
  causal_attention  kvjax.kernels.causal_attention.causal_attention_reference (no Pallas kernel)
  quantized_matmul  kvjax.kernels.quantized.quantized_matmul_reference (no Pallas kernel)
  dequantize        kvjax.kernels.quantized.dequantize_reference (no Pallas kernel)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Callable
import warnings


# Names, not the modules: kvjax.kernels re-exports the kernel function under the
# module's own name, so `from kvjax.kernels import paged_attention` is the function.
from kvjax.kernels.compaction import compact_slots
from kvjax.kernels.compaction import compact_slots_reference
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference
from kvjax.kernels import native
from kvjax.kernels import platform as platform_lib
from kvjax.kernels import quantized
from kvjax.kernels.causal_attention import causal_attention_fused
from kvjax.kernels.causal_attention import causal_attention_reference
from kvjax.kernels import segmentation
from kvjax.kernels.window_scoring import token_norms
from kvjax.kernels.window_scoring import token_norms_reference
from kvjax.kernels.window_scoring import window_scores
from kvjax.kernels.window_scoring import window_scores_reference
from kvjax import backend_choices
from kvjax import paths

BACKENDS = ("auto", "xla", "pallas", "native")
# Setting it to "0" keeps "auto" off the native kernels.
NATIVE_ENV = "KVJAX_NATIVE"


# Pallas implementations take the execution's ``interpret`` and ``target`` (the
# platform whose compiled form a kernel lowers to).
def _pallas_paged_attention(q, k_pages, v_pages, page_table, lengths, *, return_weights=False,
                            interpret, target):
  """The Pallas kernel with the reference's signature (interpreted on CPU)."""
  return paged_attention(q, k_pages, v_pages, page_table, lengths,
                         return_weights=return_weights, interpret=interpret, target=target)


def _pallas_window_scores(q, k, lengths, *, window, pool=1, group="mean", v=None,
                          return_norms=False, interpret, target):
  return window_scores(q, k, lengths, window=window, pool=pool, group=group, v=v,
                       return_norms=return_norms, interpret=interpret, target=target)


def _pallas_token_norms(x, *, interpret, target):
  return token_norms(x, interpret=interpret, target=target)


def _pallas_compact_slots(pools, page_table, lengths, new_lengths, keep, start, *, fills,
                          sources=None, interpret, target):
  return compact_slots(pools, page_table, lengths, new_lengths, keep, start, fills=fills,
                       sources=sources, interpret=interpret, target=target)


def _pallas_segment_ids(cut_after, lengths, *, max_segment, min_segment, interpret, target):
  return segmentation.segment_ids(cut_after, lengths, max_segment=max_segment,
                                  min_segment=min_segment, interpret=interpret, target=target)


def _pallas_dynamic_split(density, candidate, lengths, *, chunk, delta, alpha, interpret,
                          target):
  return segmentation.dynamic_split(density, candidate, lengths, chunk=chunk, delta=delta,
                                    alpha=alpha, interpret=interpret, target=target)


def _fused_causal_attention(q, k, v, *, interpret, target, **options):
  del interpret  # no Pallas body of its own: its forms are the platform's kernels
  return causal_attention_fused(q, k, v, target=target, **options)


# op -> backend -> implementation.
_OPS: dict[str, dict[str, Callable]] = {
    "paged_attention": {"xla": paged_attention_reference, "pallas": _pallas_paged_attention,
                        "native": native.paged_attention_cpu},
    "window_scores": {"xla": window_scores_reference, "pallas": _pallas_window_scores},
    "token_norms": {"xla": token_norms_reference, "pallas": _pallas_token_norms},
    "compact_slots": {"xla": compact_slots_reference, "pallas": _pallas_compact_slots},
    "segment_ids": {"xla": segmentation.segment_ids_checked, "pallas": _pallas_segment_ids},
    "dynamic_split": {"xla": segmentation.dynamic_split_checked, "pallas": _pallas_dynamic_split},
    "causal_attention": {"xla": causal_attention_reference,
                         "native": native.causal_attention_cpu,
                         "fused": _fused_causal_attention},
    "quantized_matmul": {"xla": quantized.quantized_matmul_reference,
                         "native": native.quantized_matmul_cpu},
    "dequantize": {"xla": quantized.dequantize_reference, "native": native.dequantize_cpu},
}


def ops() -> list[str]:
  """Names of the registered ops."""
  return sorted(_OPS)


def implementations(op: str) -> dict[str, Callable]:
  """``op``'s registered implementations by name ("xla", "pallas", "native", "fused")."""
  return dict(_OPS[op])


def register(op: str, backend: str, fn: Callable) -> None:
  """Registers an implementation of ``op`` (new or existing) for a concrete backend."""
  if backend not in ("xla", "pallas", "native"):
    raise ValueError(f"can register only 'xla', 'pallas' or 'native' implementations, "
                     f"got {backend!r}")
  _OPS.setdefault(op, {})[backend] = fn


NativeUnavailable = native.NativeUnavailable


@functools.cache
def _native_error() -> str | None:
  """Why the native kernels cannot run here (None when they can); builds them once."""
  folder = paths.cache_dir() / "native"
  try:
    native.load(folder)
  except native.NativeUnavailable as e:
    return str(e)
  except OSError as e:  # the cache folder: unwritable, full, or under a file
    return f"cannot build into {folder}: {e}"
  return None


@functools.cache
def _warn_native_unavailable(error: str) -> None:
  warnings.warn(f"kvjax: native CPU kernels unavailable, using XLA: {error}", stacklevel=3)


def native_available(platform: str | None = None) -> bool:
  """Whether backend "native" runs for ``platform`` (None: the default device's):
  a CPU, and kernels that build.

  The first call compiles them (seconds) unless a build is cached; a failure
  is warned about once and "auto" then stays on XLA.
  """
  if platform_lib.resolve_target(platform) != "cpu":
    return False
  error = _native_error()
  if error is not None:
    _warn_native_unavailable(error)
  return error is None


def _auto(op: str, platform: str, choices) -> str:
  """What "auto" runs for ``op`` on ``platform``: the table's choice where it can run, else XLA."""
  choice = backend_choices.auto_choice(platform, op, choices).backend
  if choice not in _OPS[op]:
    return "xla"
  if choice == "native":
    wanted = os.environ.get(NATIVE_ENV, "1") != "0"
    return "native" if wanted and native_available(platform) else "xla"
  return choice


def resolve(backend: str, op: str = "paged_attention", *, platform: str | None = None,
            choices=None) -> str:
  """The concrete implementation ("xla", "pallas", "native", ...) that runs ``op`` under
  ``backend`` for ``platform`` (None: the default device's).

  ``choices``: a measured-choices file for "auto" (``kvjax.backend_choices``).

  Raises:
    ValueError: an unknown backend or op, or "native" off the CPU.
    NativeUnavailable: "native" where the C++ kernels do not build (the reason).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if op not in _OPS:
    raise ValueError(f"unknown kernel op {op!r}; known ops: {ops()}")
  impls = _OPS[op]
  platform = platform_lib.resolve_target(platform)
  if backend == "auto":
    return _auto(op, platform, choices)
  if backend == "native":
    if platform != "cpu":
      raise ValueError(f"backend 'native' runs on CPU only; the platform is {platform}")
    if "native" not in impls:
      return "xla"
    error = _native_error()
    if error is not None:
      raise NativeUnavailable(f"backend 'native' cannot run here: {error}")
    return "native"
  return backend if backend in impls else "xla"


# Implementations that take the execution's ``interpret`` and ``target``.
_TAKE_TARGET = ("pallas", "fused")


def implementation(op: str, name: str, *, platform: str, interpret: bool) -> Callable:
  """``op``'s implementation ``name`` (a ``resolve`` result), built for ``platform``.

  Pallas kernels get ``interpret`` (their body in Pallas' interpreter, on a
  CPU) and ``target``; the others take neither.
  """
  fn = _OPS[op][name]
  if name in _TAKE_TARGET:
    return functools.partial(fn, interpret=interpret, target=platform)
  return fn


def get(op: str, backend: str | None = None) -> Callable:
  """The implementation of ``op`` for a backend (default: the ambient ``current()``),
  for the default device. For users' own code; the library's programs take
  theirs from their ``kvjax.execution.Execution``."""
  name = resolve(current() if backend is None else backend, op)
  platform = platform_lib.resolve_target(None)
  return implementation(op, name, platform=platform, interpret=platform == "cpu")


_CURRENT = contextvars.ContextVar("kvjax_backend", default="xla")


def current() -> str:
  """The ambient backend (set by ``use``; "xla" outside it)."""
  return _CURRENT.get()


@contextlib.contextmanager
def use(backend: str):
  """Makes ``backend`` the ambient one inside the block: sugar for a user's own code.

  Read by ``get`` and ``kvjax.execution.ambient`` (what the cache's entry
  points use when called without an ``ex``); generate's programs take their
  execution as an argument and never read it.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  with platform_lib.scoped(_CURRENT, backend):
    yield
