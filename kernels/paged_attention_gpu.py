"""Paged decode attention on GPUs: flash-decoding (the "split" form).

The layout and contract are ``kvjax.kernels.paged_attention``'s; this module
holds the GPU (Triton) form that its ``paged_attention`` runs off TPU.

A decode step has one query token per sequence, so B * K (sequence, KV head)
pairs carry all the work: a handful at batch 1, next to a GPU's ~132 SMs. One
program per pair leaves the chip idle and the pages' bandwidth unused. The
slots of each pair are therefore divided among ``num_splits`` programs:

  pass 1 (Pallas, Triton)  grid (B, K / hb, splits). Program (b, kb, s) counts
      the blocks of C = pages_per_block * S_page slots its heads fill and
      reduces the s-th contiguous share of them for all G query heads of each
      KV head: pages gathered from the pool through the page table (loads in
      the pool's dtype), logits and value products with float32 accumulation,
      online softmax within the share. It writes the share's running max
      m [G], denominator l [G] and unnormalised output acc [G, H], float32.
  pass 2 (XLA)  merges the shares: M = max_s m_s, l = sum_s l_s exp(m_s - M),
      out = sum_s acc_s exp(m_s - M) / l, lse = M + log l (``merge_splits``).
      It reads B * K * splits * G * (H + 2) floats, nothing next to the pages.

Shares follow each head's length, not its capacity (P_max): a cache filled to
a quarter still keeps every program busy, and programs past the filled blocks
write m = -inf, l = 0, acc = 0, which the merge ignores. The number of splits
is static (``PagedAttentionBlockSizes.num_splits``, by default enough programs
to fill the chip, 1 when B * K already does).

With ``return_weights`` the kernel also writes each visited block's
exp(logit - running max) and that max, which the wrapper rescales by
exp(max - lse), as for the TPU form. Without it nothing more is written.

Triton compiles power-of-two array shapes only, and tl.dot wants every side
>= 16: the G query heads are padded with zero queries to max(16, next power
of two), and pages_per_block, S_page, H and hb must be powers of two with
C >= 16 and H >= 16. The pool and the page table are whole-array refs
(pointers, not loaded whole), so their sizes are free.

On CPU the same kernel runs in Pallas' generic interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.kernels import platform
from kvjax.kernels.paged_attention_common import attend_block
from kvjax.kernels.paged_attention_common import finish


def paged_attention_split_kernel(
    table_ref, lengths_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *weight_refs,
    pages_per_block: int, num_splits: int, scale: float):
  """Grid (B, K / hb, splits): one share of the blocks of hb (sequence, KV head)s.

  Refs (hb = KV heads per program, G_pad = padded query heads per KV head):
    table_ref: [hb, P_pad] int32 page ids of these (sequence, KV head)s.
    lengths_ref: [hb] int32 their lengths.
    q_ref: [hb, G_pad, H] their query heads.
    k_ref, v_ref: [P, S_page, H] the whole pools.
    m_ref, l_ref: [hb, G_pad] the share's running max and denominator.
    acc_ref: [hb, G_pad, H] the share's unnormalised output, float32.
    weight_refs: with return_weights, block numerators [hb, blocks, G_pad, C]
      and the running max each was taken against [hb, blocks, G_pad]; every
      split of a head writes the blocks of its own share.
  """
  page_size, h = k_ref.shape[1:]
  c = pages_per_block * page_size
  hb, g = q_ref.shape[:2]
  max_blocks = table_ref.shape[1] // pages_per_block
  split = pl.program_id(2)

  for i in range(hb):
    length = lengths_ref[i]
    q = q_ref[i]

    def block(j, carry, i=i, length=length, q=q):
      pages = jnp.maximum(table_ref[i, pl.ds(j * pages_per_block, pages_per_block)], 0)
      k = k_ref[pages].reshape(c, h)
      v = v_ref[pages].reshape(c, h)
      slot = j * c + jnp.arange(c)
      carry, p = attend_block(q, k, v, slot[None, :] < length, slot[:, None] < length, carry,
                               scale=scale)
      if weight_refs:
        weight_refs[0][i, j] = p
        weight_refs[1][i, j] = carry[0].reshape(g)
      return carry

    # Only blocks below the length are visited (each holds a valid slot, as
    # the online softmax needs), never past the table should a length exceed
    # P_max * S_page. The shares of one head differ by at most one block.
    used = jnp.minimum(pl.cdiv(length, c), max_blocks)
    share = pl.cdiv(used, num_splits)
    first = split * share
    last = jnp.minimum(first + share, used)
    init = (jnp.full((g, 1), -jnp.inf, jnp.float32), jnp.zeros((g, 1), jnp.float32),
            jnp.zeros((g, h), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, block, init)  # no trips when first >= last
    m_ref[i] = m.reshape(g)
    l_ref[i] = l.reshape(g)
    acc_ref[i] = acc


def merge_splits(m, l, acc):
  """Merges the shares: m, l [B, K, splits, G], acc [B, K, splits, G, H] (float32).

  Returns out [B, K, G, H] float32 (zeros for an empty head) and lse [B, K, G]
  (-inf for an empty head).
  """
  top = m.max(axis=2)  # [B, K, G]
  # An empty head's shares all have m = -inf: 0 in place of its max keeps
  # exp(-inf - 0) = 0 instead of NaN; so does an empty share of any head.
  weight = jnp.exp(m - jnp.where(jnp.isneginf(top), 0.0, top)[:, :, None])
  l = (l * weight).sum(axis=2)
  acc = (acc * weight[..., None]).sum(axis=2)
  out, lse = finish((top[..., None], l[..., None], acc))
  return out, lse[..., 0]


def check_triton_shapes(*, pages_per_block: int, page_size: int, head_dim: int,
                        kv_heads_per_block: int) -> None:
  """Raises ValueError unless the sizes give Triton power-of-two shapes (tl.dot sides >= 16)."""
  for name, value in (("pages_per_block", pages_per_block), ("page_size", page_size),
                      ("head_dim", head_dim), ("kv_heads_per_block", kv_heads_per_block)):
    if value & (value - 1):
      raise ValueError(f"the GPU (Triton) kernel needs {name} to be a power of two, got {value}")
  if pages_per_block * page_size < platform.MIN_DOT or head_dim < platform.MIN_DOT:
    raise ValueError(
        f"the GPU (Triton) kernel needs pages_per_block * page_size "
        f"({pages_per_block} * {page_size}) and head_dim ({head_dim}) >= {platform.MIN_DOT}")


def call_split(q, k_pages, v_pages, table, lengths, *, ppb, hb, num_splits, return_weights,
               interpret):
  """Runs both passes. q [B, K, G, H]; table [B, K, P_pad] (a multiple of ppb); lengths [B, K].

  Returns out [B, K, G, H] in q's dtype, lse [B, K, G] and, with
  return_weights, block numerators [B, K, blocks, G, C] and their running
  maxima [B, K, blocks, G] (the pipelined TPU form's results).
  """
  b, kh, g, h = q.shape
  p_pad = table.shape[2]
  page_size = k_pages.shape[1]
  nb, c = p_pad // ppb, ppb * page_size
  if not interpret:
    check_triton_shapes(pages_per_block=ppb, page_size=page_size, head_dim=h,
                        kv_heads_per_block=hb)
  g_pad = platform.pad_rows(g, platform.GPU)
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
  f32 = jnp.float32
  pool = pl.BlockSpec(k_pages.shape, lambda bi, kb, s: (0, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((b, kh, num_splits, g_pad), f32),
               jax.ShapeDtypeStruct((b, kh, num_splits, g_pad), f32),
               jax.ShapeDtypeStruct((b, kh, num_splits, g_pad, h), f32)]
  share_spec = pl.BlockSpec((None, hb, None, g_pad), lambda bi, kb, s: (bi, kb, s, 0))
  out_specs = [share_spec, share_spec,
               pl.BlockSpec((None, hb, None, g_pad, h), lambda bi, kb, s: (bi, kb, s, 0, 0))]
  if return_weights:
    out_shape += [jax.ShapeDtypeStruct((b, kh, nb, g_pad, c), f32),
                  jax.ShapeDtypeStruct((b, kh, nb, g_pad), f32)]
    out_specs += [pl.BlockSpec((None, hb, nb, g_pad, c), lambda bi, kb, s: (bi, kb, 0, 0, 0)),
                  pl.BlockSpec((None, hb, nb, g_pad), lambda bi, kb, s: (bi, kb, 0, 0))]
  kernel = functools.partial(paged_attention_split_kernel, pages_per_block=ppb,
                             num_splits=num_splits, scale=h ** -0.5)
  m, l, acc, *weights = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(b, kh // hb, num_splits),
      in_specs=[pl.BlockSpec((None, hb, p_pad), lambda bi, kb, s: (bi, kb, 0)),
                pl.BlockSpec((hb,), lambda bi, kb, s: (bi * (kh // hb) + kb,)),
                pl.BlockSpec((None, hb, g_pad, h), lambda bi, kb, s: (bi, kb, 0, 0)),
                pool, pool],
      out_specs=out_specs,
      # Triton, explicitly (see ``platform``): this jax lowers GPU kernels to
      # Mosaic GPU by default.
      compiler_params=platform.compiler_params(platform.GPU, 3),
      interpret=interpret,
  )(table, lengths.reshape(-1), qp, k_pages, v_pages)
  out, lse = merge_splits(m[..., :g], l[..., :g], acc[..., :g, :])
  outs = [out.astype(q.dtype), lse]
  if return_weights:
    outs += [weights[0][:, :, :, :g], weights[1][..., :g]]
  return outs
