"""Native CPU kernels: C++ compiled on first use, called through XLA's FFI.

  paged_attention_cpu     paged decode attention (paged_attention_cpu.cc), the
                          reference's signature; float32 only, no weights.
  causal_attention_cpu    a prompt's causal attention, flash-style
                          (causal_attention_cpu.cc); float32.
  quantized_matmul_cpu    activations times GGUF Q4_1 / Q8_0 blocks as stored
  dequantize_cpu          (quantized_matmul_cpu.cc); kvjax.kernels.quantized's
                          references' signatures.

The source ships with the package and is compiled with the machine's C++
compiler ($CXX, else ``c++``) into a folder keyed by everything the binary
depends on (source, compiler, flags, jaxlib version, CPU), so a changed
source or a new jaxlib builds afresh and an unchanged one loads in
milliseconds. ``load`` builds (if needed), loads the library and registers
its FFI target once per process; ``kvjax.backend`` calls it for the
``"native"`` backend, with the build folder under kvjax's cache folder.
Without a compiler ``build`` raises ``NativeUnavailable``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels import quantized
from kvjax.kernels.causal_attention import causal_attention_reference
from kvjax.kernels.paged_attention import paged_attention_reference

_HERE = pathlib.Path(__file__).parent
# Compiled together into one library; the header is part of the build key.
SOURCES = (_HERE / "paged_attention_cpu.cc", _HERE / "causal_attention_cpu.cc",
           _HERE / "quantized_matmul_cpu.cc")
HEADERS = (_HERE / "cpu_math.h", _HERE / "cpu_parallel.h", _HERE / "cpu_tile.h")
# FFI target -> the handler symbol the library exports.
TARGETS = {"kvjax_paged_attention_cpu": "KvjaxPagedAttentionCpu",
           "kvjax_causal_attention_cpu": "KvjaxCausalAttentionCpu",
           "kvjax_quantized_matmul_cpu": "KvjaxQuantizedMatmulCpu",
           "kvjax_dequantize_cpu": "KvjaxDequantizeCpu"}
_LIBRARY = "libkvjax_native.so"
# -fopenmp-simd honours the source's `omp simd` pragmas (vectorised reductions)
# without OpenMP's runtime. -march=native is tried first and dropped if the
# compiler refuses it.
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-w")
_ARCH_FLAGS = ("-march=native",)


class NativeUnavailable(RuntimeError):
  """The native kernels cannot be built or loaded on this machine."""


def compiler() -> str:
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not cxx:
    raise NativeUnavailable("no C++ compiler found (set $CXX or install g++)")
  return cxx


def _cpu_id() -> str:
  """What -march=native depends on: the CPU's model and feature flags."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  wanted = ("model name", "flags", "Features", "CPU part")
  return "\n".join(sorted({l for l in lines if l.split(":")[0].strip() in wanted}))


def _build_key(cxx: str) -> str:
  try:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise NativeUnavailable(f"C++ compiler {cxx!r} does not run: {e}") from e
  parts = (*(f.read_bytes() for f in SOURCES + HEADERS), cxx.encode(), version.encode(), " ".join(_FLAGS).encode(),
           importlib.metadata.version("jaxlib").encode(), _cpu_id().encode())
  digest = hashlib.sha256()
  for part in parts:
    digest.update(len(part).to_bytes(8, "little") + part)
  return digest.hexdigest()[:16]


def build(build_dir: str | os.PathLike) -> pathlib.Path:
  """Compiles the kernels into ``build_dir/<key>/`` unless already there; returns the library.

  Raises:
    NativeUnavailable: no compiler, or the compiler failed (its message included).
  """
  cxx = compiler()
  target = pathlib.Path(build_dir) / _build_key(cxx) / _LIBRARY
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # Compile to a temporary name, then rename: a concurrent process never
  # loads a half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  command = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
  try:
    for arch in (_ARCH_FLAGS, ()):
      done = subprocess.run(command[:1] + list(arch) + command[1:], capture_output=True,
                            text=True, timeout=600)
      if done.returncode == 0:
        os.replace(tmp, target)
        return target
  except (OSError, subprocess.SubprocessError) as e:
    raise NativeUnavailable(f"compiling {_names()} failed: {e}") from e
  finally:
    pathlib.Path(tmp).unlink(missing_ok=True)
  raise NativeUnavailable(f"compiling {_names()} with {cxx} failed:\n{done.stderr[-2000:]}")


def _names() -> str:
  return " ".join(f.name for f in SOURCES)


_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL] = {}  # the one loaded library, kept alive


def load(build_dir: str | os.PathLike) -> pathlib.Path:
  """Builds if needed, loads the library and registers its FFI target (once per process).

  Later calls return at once (with whichever library the first one loaded).
  """
  with _LOCK:
    if not _LOADED:
      path = build(build_dir)
      try:
        library = ctypes.CDLL(str(path))
      except OSError as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
      for target, handler in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, handler)),
                                    platform="cpu")
      _LOADED[str(path)] = library
    return pathlib.Path(next(iter(_LOADED)))


def loaded() -> bool:
  """Whether ``load`` has registered the kernels in this process."""
  return bool(_LOADED)


def paged_attention_cpu(q, k_pages, v_pages, page_table, lengths, *, return_weights=False):
  """Paged decode attention in C++; ``paged_attention_reference``'s signature and result.

  Shapes as there: q [B, N, H], k_pages/v_pages [P, S_page, H], page_table
  [B, K, P_max], lengths [B, K] -> out [B, N, H]. With ``return_weights`` or
  non-float32 inputs it runs the reference (the C++ kernel computes neither).
  Needs ``load`` first (``kvjax.backend`` does it for backend "native").
  """
  f32 = jnp.dtype(jnp.float32)
  if return_weights or any(x.dtype != f32 for x in (q, k_pages, v_pages)):
    return paged_attention_reference(q, k_pages, v_pages, page_table, lengths,
                                     return_weights=return_weights)
  _check_loaded()
  call = jax.ffi.ffi_call("kvjax_paged_attention_cpu", jax.ShapeDtypeStruct(q.shape, q.dtype),
                          vmap_method="sequential")
  return call(q, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32))


def causal_attention_cpu(q, k, v, *, block=None):
  """Causal GQA attention in C++: q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H].

  ``causal_attention_reference``'s result; ``block`` (the XLA form's tile) is
  accepted and ignored, the kernel has tiles of its own. Non-float32 inputs run
  the reference.
  """
  f32 = jnp.dtype(jnp.float32)
  if any(x.dtype != f32 for x in (q, k, v)):
    kwargs = {} if block is None else dict(block=block)
    return causal_attention_reference(q, k, v, **kwargs)
  _check_loaded()
  call = jax.ffi.ffi_call("kvjax_causal_attention_cpu", jax.ShapeDtypeStruct(q.shape, q.dtype),
                          vmap_method="sequential")
  return call(q, k, v)


def _check_loaded():
  if not loaded():
    raise NativeUnavailable("the native kernels are not loaded: call "
                            "kvjax.kernels.native.load(build_dir) or use kvjax.backend")


def quantized_matmul_cpu(x, w):
  """x [..., D_in] times packed w [D_out, R] (Q4_1 / Q8_0 rows) -> float32 [..., D_out].

  ``kvjax.kernels.quantized.quantized_matmul_reference``'s signature and result,
  without the float weights: a few rows (a decode step) read the blocks in
  place, more (a prompt) run a GEMM that dequantizes a panel at a time.
  Non-float32 x runs the reference.
  """
  d_in = x.shape[-1]
  fmt = quantized.block_format(w.shape[-1], d_in)
  if jnp.dtype(x.dtype) != jnp.float32 or w.ndim != 2:
    return quantized.quantized_matmul_reference(x, w)
  _check_loaded()
  rows = x.reshape(-1, d_in)
  call = jax.ffi.ffi_call("kvjax_quantized_matmul_cpu",
                          jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32),
                          vmap_method="sequential")
  out = call(rows, w, format=np.int32(fmt.ggml_type))
  return out.reshape(*x.shape[:-1], w.shape[0])


def dequantize_cpu(w, d_in: int, *, transpose: bool = False):
  """Packed w [D_out, R] -> float32 [D_out, D_in], or [D_in, D_out] with ``transpose``.

  ``kvjax.kernels.quantized.dequantize_reference`` (then ``.T``), computed in C++.
  """
  fmt = quantized.block_format(w.shape[-1], d_in)
  if w.ndim != 2:
    out = quantized.dequantize_reference(w, d_in)
    return jnp.swapaxes(out, -1, -2) if transpose else out
  _check_loaded()
  shape = (d_in, w.shape[0]) if transpose else (w.shape[0], d_in)
  call = jax.ffi.ffi_call("kvjax_dequantize_cpu", jax.ShapeDtypeStruct(shape, jnp.float32),
                          vmap_method="sequential")
  return call(w, format=np.int32(fmt.ggml_type), transpose=np.int32(transpose))
