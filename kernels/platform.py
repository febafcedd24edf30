"""The one place where kernels choose between the TPU and the GPU Pallas lowering.

TPU: Mosaic. Blocks' last two dims must be multiples of (8, 128) or the full
array dims; scalar prefetch, VMEM scratch and DMAs are available.

GPU: Triton. The installed jax (0.10) still ships Pallas' Triton lowering;
jax 0.11 deprecates it in favour of Mosaic GPU, which this jax already uses
by default for GPU kernels (and which would stage whole blocks in shared
memory for our gather-style kernels). Kernels therefore ask for Triton
explicitly through ``compiler_params`` below; moving to Mosaic GPU means
changing this module, not the kernels. Triton wants power-of-two array shapes
and ``tl.dot`` operands with every side >= 16, so kernels pad rows with
``pad_rows`` and check sizes with ``check_triton``.

CPU: kernels run in Pallas' interpreter. The generic interpreter runs the
GPU form; ``pltpu.force_tpu_interpret_mode()`` (or an ``InterpretParams``
passed as ``interpret``) runs the TPU form, scalar prefetch and DMAs included.

The TPU and GPU Pallas modules (``tpu()``, ``triton()``) are imported when a
kernel first builds its call, not with kvjax: a CPU process on the native or
XLA backend never uses them, and they would hold ~9 MiB of its memory.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

TPU = "mosaic_tpu"
GPU = "triton"
# tl.dot needs at least this many rows and columns.
MIN_DOT = 16


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


def lowering(interpret) -> str:
  """TPU (Mosaic) or GPU (Triton) form for a kernel called with this ``interpret``."""
  if isinstance(interpret, tpu().InterpretParams) or tpu_interpret_forced():
    return TPU
  return TPU if jax.default_backend() == "tpu" else GPU


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
