"""The one place where kernels choose between the TPU and the GPU Pallas lowering.

TPU: Mosaic. Blocks' last two dims must be multiples of (8, 128) or the full
array dims; scalar prefetch, VMEM scratch and DMAs are available.

GPU: Triton, asked for explicitly through ``compiler_params`` below (jax's
default GPU lowering is Mosaic GPU). Triton wants power-of-two array shapes
and ``tl.dot`` operands with every side >= 16, so kernels pad rows with
``pad_rows`` and check sizes with ``check_triton``.

Why Triton and not Mosaic GPU (for paged attention, the kernel that matters
on GPU), decided without a GPU at hand from what jax 0.10.2 here and the jax
0.11.0 sources show:
  - Both lower from a CPU jaxlib, and both have a CPU interpreter.
  - The paged kernels gather a block of pages with one vector of page ids
    (``pool_ref[pages]``). Triton lowers that to one pointer gather per block
    of several pages. Mosaic GPU has no such gather (indexing a ref with a
    vector fails to lower: "Only arrays with tiled layouts can be sliced"
    under Lane semantics, "int_indexer_shape non-empty" under Warpgroup);
    its way is one TMA copy and barrier per page, 2 KiB for a page of 16
    slots at H = 64, with the page ids first copied into shared memory
    (lowering wants multiples of 128 elements there). Such a loop lowers
    here only with ``LoweringSemantics.Warpgroup`` pinned, the default from
    jax 0.11 but not in 0.10 (Lane), and its products go through wgmma's
    64-row tiles: a design whose speed only the device can tell.
  - The Triton form of paged attention (then one program per head) already
    ran on an H200 under jax 0.11.2 and matched its reference; the split
    (flash-decoding) form changes the grid and each program's share of
    blocks, not the ops lowered.
  - jax 0.11 deprecates the Pallas Triton lowering (a "jax-pallas-triton"
    DeprecationWarning when a kernel lowers; not removed) and equally
    ``pl.pallas_call`` for Mosaic GPU kernels (``plgpu.kernel`` instead).
So GPU kernels stay on Triton until a Mosaic GPU paged kernel is measured
against it on the device; moving means setting ``GPU`` below and giving the
GPU kernel modules a Mosaic GPU body, not touching the callers.

CPU: kernels run in Pallas' interpreter. The generic interpreter runs the
GPU form; ``pltpu.force_tpu_interpret_mode()`` (or an ``InterpretParams``
passed as ``interpret``) runs the TPU form, scalar prefetch and DMAs included.

The TPU and GPU Pallas modules (``tpu()``, ``triton()``) are imported when a
kernel first builds its call, not with kvjax: a CPU process on the native or
XLA backend never uses them, and they would hold ~9 MiB of its memory.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.experimental import pallas as pl

TPU = "mosaic_tpu"
# The GPU lowering (see the module docstring): "triton"; "mosaic_gpu" is the
# other one jax offers.
GPU = "triton"
# tl.dot needs at least this many rows and columns.
MIN_DOT = 16


# Platforms by jax.default_backend()'s names.
PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET = contextvars.ContextVar("kvjax_target_platform", default=None)


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value):
  """Sets ``var`` to ``value`` inside the block and back to what it was after."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def ambient_target() -> str | None:
  """The platform ``targeting`` names, None outside it.

  Read only where an ``Execution`` is built (``kvjax.execution.create``):
  kernels take their target as an argument.
  """
  return _TARGET.get()


def resolve_target(target: str | None) -> str:
  """``target``, or the default device's platform for None."""
  return target or jax.default_backend()


@contextlib.contextmanager
def targeting(name: str):
  """Builds executions for platform ``name`` ("cpu", "gpu" or "tpu") inside the block.

  Sugar for lowering a program for a chip this machine lacks: an execution
  created inside (``kvjax.execution.create``) takes that chip's compiled
  kernels and resolves ``"auto"`` as it would there. Programs and kernels
  read their target from their arguments, never from here.
  """
  if name not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {name!r}")
  with scoped(_TARGET, name):
    yield


def tpu():
  """``jax.experimental.pallas.tpu`` (Mosaic), imported on first use."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  return pltpu


def triton():
  """``jax.experimental.pallas.triton``, imported on first use."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return pltriton


def tpu_interpret_forced() -> bool:
  """Whether ``pltpu.force_tpu_interpret_mode()`` is active (then the TPU form runs)."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
  return flag is not None and flag.value is not None


def lowering(interpret, target: str | None = None) -> str:
  """TPU (Mosaic) or GPU (Triton) form of a kernel called with this ``interpret``,
  built for ``target`` (None: the default device's platform)."""
  if isinstance(interpret, tpu().InterpretParams) or tpu_interpret_forced():
    return TPU
  return TPU if resolve_target(target) == "tpu" else GPU


def compiler_params(form: str, num_dims: int, *, sequential_last: bool = False):
  """Compiler parameters of a ``num_dims`` grid for the form.

  ``sequential_last``: the last grid axis carries state (TPU "arbitrary").
  """
  if form == TPU:
    sems = ("parallel",) * (num_dims - 1) + ("arbitrary" if sequential_last else "parallel",)
    return tpu().CompilerParams(dimension_semantics=sems)
  return triton().CompilerParams(num_warps=4, num_stages=2)


def pad_rows(rows: int, form: str) -> int:
  """Rows of a matmul operand, padded for the form: a multiple of 8 on TPU,
  a power of two >= 16 on GPU."""
  if form == TPU:
    return max(8, pl.cdiv(rows, 8) * 8)
  return max(MIN_DOT, pl.next_power_of_2(rows))


def check_triton(**sizes: int) -> None:
  """Raises ValueError unless every size is a power of two >= 16 (Triton's shapes)."""
  for name, value in sizes.items():
    if value & (value - 1) or value < MIN_DOT:
      raise ValueError(f"the GPU (Triton) kernel needs {name} to be a power of two >= "
                       f"{MIN_DOT}, got {value}")
