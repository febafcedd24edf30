"""Pieces both forms of paged decode attention share: block sizes and the softmax step.

``kvjax.kernels.paged_attention`` (the reference, the TPU form, the wrapper)
and ``kvjax.kernels.paged_attention_gpu`` (the GPU form) build on this module;
the layout and shapes are described there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.kernels import platform

# Slots one compute block spans by default: one full lane row of a TPU vreg,
# and a tl.dot width that keeps a GPU's tensor cores busy.
_DEFAULT_BLOCK_SLOTS = 128
# Programs that fill a GPU: ~132 SMs (H100, H200) times a few resident
# programs each, so that one program's page loads overlap another's math.
_GPU_PROGRAMS = 4 * 132
# The fewest blocks a split reduces by default: shorter shares spend more on
# writing and merging their partial state than on reading pages.
_MIN_BLOCKS_PER_SPLIT = 2


@dataclasses.dataclass(frozen=True)
class PagedAttentionBlockSizes:
  """How the kernel divides its work: pages per block, heads per program, splits.

  Attributes:
    pages_per_block: pages attended together in one online-softmax step
      (C = pages_per_block * S_page slots). Wider blocks give wider matmuls and
      fewer rescales; the page table is padded with absent pages to a multiple.
    kv_heads_per_block: KV heads (each with its G query heads) one grid
      program serves; must divide K. More heads per program amortise the
      per-step cost when heads are short; fewer give more parallel programs.
    num_splits: programs sharing the blocks of one (sequence, KV head) in the
      GPU (split) form, each reducing a contiguous share of the filled blocks
      (flash-decoding); the TPU (pipelined) form walks a head's blocks in one
      program and takes only 1.
  """

  pages_per_block: int
  kv_heads_per_block: int = 1
  num_splits: int = 1

  def __post_init__(self):
    for name in ("pages_per_block", "kv_heads_per_block", "num_splits"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

  @classmethod
  def get_default(cls, page_size: int, max_pages: int, *, batch: int = 1, kv_heads: int = 1,
                  form: str = platform.TPU) -> "PagedAttentionBlockSizes":
    """Block sizes for a [B, K, P_max] page table in the given form (``platform.TPU``/``GPU``).

    Pages per block: at most _DEFAULT_BLOCK_SLOTS slots and P_max pages, a
    power of two (Triton's blocks must be). Splits (GPU form only): enough
    programs, B * K * splits, to fill the chip (_GPU_PROGRAMS), a power of
    two, at most one split per _MIN_BLOCKS_PER_SPLIT blocks; 1 where B * K
    already fills it.
    """
    fit = max(1, min(max_pages, _DEFAULT_BLOCK_SLOTS // page_size))
    ppb = 1 << (fit.bit_length() - 1)
    splits = 1
    if form != platform.TPU:
      num_blocks = -(-max_pages // ppb)
      want = max(1, min(_GPU_PROGRAMS // (batch * kv_heads),
                        num_blocks // _MIN_BLOCKS_PER_SPLIT))
      splits = 1 << (want.bit_length() - 1)
    return cls(pages_per_block=ppb, num_splits=splits)


# ------------------------------------------------------------------ softmax step


def attend_block(q, k, v, valid, valid_rows, carry, *, scale):
  """One online-softmax step over a block of C slots (shared by both kernels).

  Args:
    q: [G, H] the query heads of one KV head.
    k, v: [C, H] the block's keys and values.
    valid: [1, C] bool, slots below the head's length. At least one must be
      true: a block with none would turn the running max into -inf - -inf.
    valid_rows: [C, H] (or [C, 1]) bool, the same per value row: invalid rows
      are zeroed, as a zero weight does not cancel a NaN or Inf left there by
      a page's other or previous owner (0 * inf = NaN).
    carry: (running max [G, 1], denominator [G, 1], accumulator [G, H]), f32.
    scale: H ** -0.5.

  Returns:
    (new carry, p [G, C] = exp(logits - new running max), zero where invalid).
  """
  m, l, acc = carry
  # Mixed q/kv dtypes meet in float32; bfloat16 x bfloat16 stays on the fast
  # matmul path with a float32 accumulator. HIGHEST keeps float32 products
  # exact (no single bf16/tf32 pass): with G rows per program decode is
  # bound by reading the pages, not by the extra matmul passes.
  dtype = jnp.promote_types(q.dtype, k.dtype)
  logits = jax.lax.dot_general(
      q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * scale
  logits = jnp.where(valid, logits, -jnp.inf)
  m_new = jnp.maximum(m, logits.max(axis=1, keepdims=True))
  rescale = jnp.exp(m - m_new)
  p = jnp.exp(logits - m_new)
  l = l * rescale + p.sum(axis=1, keepdims=True)
  v = jnp.where(valid_rows, v, jnp.zeros_like(v))
  acc = acc * rescale + jax.lax.dot_general(
      p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return (m_new, l, acc), p


def finish(carry):
  """(out [G, H], lse [G, 1]) from the softmax state; zeros and -inf for an empty head."""
  m, l, acc = carry
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)  # an empty head has acc == 0, so out is 0
  return acc / safe_l, jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)
