"""Paged decode attention: one query token per sequence against a paged KV pool.

Layout (one page holds ``S_page`` consecutive slots of one (sequence, layer,
KV head)):
  q           [B, N, H]          query of the token being decoded
  k_pages     [P, S_page, H]     key pool
  v_pages     [P, S_page, H]     value pool
  page_table  [B, K, P_max]      page ids of each (sequence, KV head), -1 = none
  lengths     [B, K]             filled slots of each (sequence, KV head)

Slot ``s`` of a head lives in page ``page_table[b, k, s // S_page]`` at offset
``s % S_page``. Query head ``n`` reads KV head ``n // G`` (G = N // K); KV heads
are never repeated.

Two implementations with one signature:
  paged_attention_reference   float32 jnp, the definition (XLA backend).
  paged_attention             Pallas kernel: online softmax over blocks of
                              pages, all G query heads of a KV head at once.

How pages reach the kernel differs between Mosaic (TPU) and Triton (GPU); the
platform is chosen in ``kvjax.kernels.platform``, the form in ``_page_fetch``:
  "pipelined" (TPU)  page table and lengths are scalar-prefetched into SMEM;
                     grid (B, K / hb, blocks); each page of a block is its own
                     BlockSpec whose index map reads the page table, so the
                     Pallas pipeline DMAs (and double-buffers) just the pages
                     a head owns; the softmax state lives in VMEM scratch.
  "split" (GPU)      flash-decoding, in ``kvjax.kernels.paged_attention_gpu``:
                     grid (B, K / hb, splits), each program gathering the
                     pages of one share of a head's blocks and writing its
                     partial softmax state; an XLA pass merges the shares.
Block sizes (pages per block, KV heads per program, splits) are a frozen
dataclass, ``PagedAttentionBlockSizes``; it and the online-softmax step both
forms share (``attend_block``, ``finish``) live in
``kvjax.kernels.paged_attention_common``.
On CPU the kernel runs in interpret mode: the generic interpreter runs the
split kernel, TPU interpret mode runs the pipelined one.

A block is about 128 slots (8 pages of 16, a lane row of a vreg) and a program
one KV head: pages belong to a (sequence, KV head), not to a sequence as in
JAX's own TPU paged-attention op, so each page is its own BlockSpec, DMAed by
the pipeline rather than by manual copies. (The tests compare the pipelined
form with that op in TPU interpret mode.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.kernels import paged_attention_gpu
from kvjax.kernels import platform
from kvjax.kernels.paged_attention_common import attend_block
from kvjax.kernels.paged_attention_common import finish
from kvjax.kernels.paged_attention_common import PagedAttentionBlockSizes

# Dtypes the kernel takes for queries, keys and values.
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
  """Reads every slot of every head: [P, S_page, ...] -> [B, K, S, ...].

  Absent pages (-1) read page 0; callers mask by length.
  """
  b, k, p_max = page_table.shape
  slots = pages[jnp.maximum(page_table, 0)]  # [B, K, P_max, S_page, ...]
  return slots.reshape(b, k, p_max * pages.shape[1], *pages.shape[2:])


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    return_weights: bool = False,
):
  """Float32 reference of paged decode attention.

  Returns out [B, N, H] in q's dtype and, with ``return_weights``, also the
  softmax weights [B, N, S] (zero on empty slots) and the log-sum-exp [B, N]
  (-inf for a head with no slots). A head with length 0 outputs zeros.
  """
  b, n, h = q.shape
  k_heads = page_table.shape[1]
  g = n // k_heads
  keys = gather_pages(k_pages, page_table).astype(jnp.float32)  # [B, K, S, H]
  values = gather_pages(v_pages, page_table).astype(jnp.float32)
  # The scale goes on the G query rows, not on the S logits.
  qg = (q.astype(jnp.float32) * (h ** -0.5)).reshape(b, k_heads, g, h)
  valid = jnp.arange(keys.shape[2])[None, None, :] < lengths[:, :, None]  # [B, K, S]
  logits = jnp.where(valid[:, :, None, :], jnp.einsum("bkgh,bksh->bkgs", qg, keys), -jnp.inf)
  # One exp per slot: the softmax is normalised after the value product (as
  # exp(logits - logsumexp) it would take two). A head with no slots
  # has max -inf; 0 in its place keeps exp(-inf - 0) = 0 instead of NaN, and
  # its sum is 0 (any other head's is at least 1: its max slot adds exp(0)).
  top = jnp.max(logits, axis=-1, keepdims=True)  # [B, K, G, 1]
  top = jnp.where(jnp.isneginf(top), 0.0, top)
  p = jnp.exp(logits - top)  # 0 on empty slots
  denom = jnp.sum(p, axis=-1, keepdims=True)
  safe = jnp.maximum(denom, 1.0)  # an empty head divides zeros by 1
  # A zero weight does not cancel a NaN or Inf value (0 * inf = NaN), and slots
  # past the length hold whatever their page (or page 0, for absent pages,
  # another sequence's) last held: mask the values, not only the weights.
  values = jnp.where(valid[..., None], values, 0.0)
  out = (jnp.einsum("bkgs,bksh->bkgh", p, values) / safe).reshape(b, n, h)
  out = out.astype(q.dtype)
  if not return_weights:
    return out
  lse = top + jnp.log(denom)  # -inf for an empty head (log 0)
  return out, (p / safe).reshape(b, n, -1), lse.reshape(b, n)


# ------------------------------------------------------------------ TPU form


def paged_attention_pipelined_kernel(
    table_ref, lengths_ref, q_ref, *refs, num_kv_heads: int, heads_per_block: int,
    pages_per_block: int, return_weights: bool, scale: float):
  """Grid (B, K / hb, blocks); the TPU form (pages arrive through BlockSpecs).

  Refs (hb = heads_per_block):
    table_ref: [B * K * P_pad] int32 page ids (scalar prefetch, SMEM).
    lengths_ref: [B * K] int32 (scalar prefetch, SMEM).
    q_ref: [hb, G, H].
    refs: hb * pages_per_block key pages [S_page, H] (head-major), as many
      value pages; then out [hb, G, H], lse [hb, G, 1]; with return_weights
      block numerators [hb, G, C] and the running max they were taken against
      [hb, G, 1]; then VMEM scratch running max [hb, G, 1], denominator
      [hb, G, 1], accumulator [hb, G, H].
  """
  ppb, hb = pages_per_block, heads_per_block
  n_pages = hb * ppb
  k_refs, v_refs = refs[:n_pages], refs[n_pages:2 * n_pages]
  out_ref, lse_ref = refs[2 * n_pages:2 * n_pages + 2]
  weight_refs = refs[2 * n_pages + 2:2 * n_pages + 4] if return_weights else ()
  m_ref, l_ref, acc_ref = refs[-3:]
  b, kb, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  c = ppb * k_refs[0].shape[0]
  start = j * c

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  # Blocks past a head's length do nothing; their index maps repeat the last
  # page, so the pipeline issues no DMA for them either. Their weight blocks
  # are left unwritten: the wrapper masks weights by length.
  def step(i, length):
    k_head = k_refs[i * ppb:(i + 1) * ppb]
    v_head = v_refs[i * ppb:(i + 1) * ppb]
    k = jnp.concatenate([r[...] for r in k_head], axis=0) if ppb > 1 else k_head[0][...]
    v = jnp.concatenate([r[...] for r in v_head], axis=0) if ppb > 1 else v_head[0][...]
    valid = start + jax.lax.broadcasted_iota(jnp.int32, (1, c), 1) < length
    # Full [C, H] (no broadcast of a mask across lanes in Mosaic).
    valid_rows = start + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) < length
    carry, p = attend_block(q_ref[i], k, v, valid, valid_rows,
                             (m_ref[i], l_ref[i], acc_ref[i]), scale=scale)
    m_ref[i], l_ref[i], acc_ref[i] = carry
    if return_weights:
      weight_refs[0][i] = p
      weight_refs[1][i] = carry[0]

  for i in range(hb):
    length = lengths_ref[b * num_kv_heads + kb * hb + i]
    pl.when(start < length)(functools.partial(step, i, length))

  @pl.when(j == pl.num_programs(2) - 1)
  def _write():
    for i in range(hb):
      out, lse = finish((m_ref[i], l_ref[i], acc_ref[i]))
      out_ref[i] = out.astype(out_ref.dtype)
      lse_ref[i] = lse


# ------------------------------------------------------------------ TPU / GPU switch


def _page_fetch(interpret, target=None) -> str:
  """"pipelined" for Mosaic, "split" for Triton (the platform is chosen in ``platform``).

  Mosaic wants scalar-prefetched tables driving BlockSpec index maps (its
  pipeline then DMAs only the pages a head owns); Triton supports neither
  scalar prefetch nor scratch, so it gathers pages inside the kernel, and
  shares each head's blocks among programs to fill the GPU. The generic CPU
  interpreter runs the split form; TPU interpret mode (an ``InterpretParams``
  or ``force_tpu_interpret_mode``) the pipelined one.
  """
  return "pipelined" if platform.lowering(interpret, target) == platform.TPU else "split"


def _call_pipelined(q, k_pages, v_pages, table, lengths, *, ppb, return_weights, interpret,
                    hb=1):
  """Runs the pipelined kernel. q [B, K, G, H]; table [B, K, P_pad]; lengths [B, K];
  hb KV heads per program.

  Returns out [B, K, G, H], lse [B, K, G] and, with return_weights, block
  numerators [B, K, blocks, G, C] and their running maxima [B, K, blocks, G].
  """
  pltpu = platform.tpu()
  b, kh, g, h = q.shape
  p_pad = table.shape[2]
  page_size = k_pages.shape[1]
  nb, c = p_pad // ppb, ppb * page_size

  def page_map(head, i):
    def index_map(bi, kb, j, table_ref, lengths_ref):
      row = bi * kh + kb * hb + head
      # Past the length, repeat the head's last page: an unchanged block index
      # makes the pipeline skip the copy.
      # lax.div (truncating, exact for lengths >= 0) rather than //: Mosaic
      # lowers floor division through a sign op that needs the chip version.
      pages_used = jax.lax.div(lengths_ref[row] + page_size - 1, page_size)
      last = jnp.clip(pages_used - 1, 0, p_pad - 1)
      page = table_ref[row * p_pad + jnp.minimum(j * ppb + i, last)]
      return jnp.maximum(page, 0), 0, 0
    return index_map

  page_specs = [pl.BlockSpec((None, page_size, h), page_map(head, i))
                for head in range(hb) for i in range(ppb)]
  heads = lambda bi, kb, j, *_: (bi, kb, 0, 0)
  blk = lambda bi, kb, j, *_: (bi, kb, j, 0, 0)
  out_shape = [jax.ShapeDtypeStruct((b, kh, g, h), q.dtype),
               jax.ShapeDtypeStruct((b, kh, g, 1), jnp.float32)]
  out_specs = [pl.BlockSpec((None, hb, g, h), heads), pl.BlockSpec((None, hb, g, 1), heads)]
  if return_weights:
    out_shape += [jax.ShapeDtypeStruct((b, kh, nb, g, c), jnp.float32),
                  jax.ShapeDtypeStruct((b, kh, nb, g, 1), jnp.float32)]
    out_specs += [pl.BlockSpec((None, hb, None, g, c), blk),
                  pl.BlockSpec((None, hb, None, g, 1), blk)]
  kernel = functools.partial(
      paged_attention_pipelined_kernel, num_kv_heads=kh, heads_per_block=hb,
      pages_per_block=ppb, return_weights=return_weights, scale=h ** -0.5)
  # The tables go in flat: SMEM pads the minor dimension of 2-D and 3-D arrays.
  # Each page of a block is its own operand (the same pool array hb * ppb times).
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kh // hb, nb),
          in_specs=[pl.BlockSpec((None, hb, g, h), heads)] + page_specs + page_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((hb, g, 1), jnp.float32),
                          pltpu.VMEM((hb, g, 1), jnp.float32),
                          pltpu.VMEM((hb, g, h), jnp.float32)]),
      compiler_params=platform.compiler_params(platform.TPU, 3, sequential_last=True),
      interpret=interpret,
  )(table.reshape(-1), lengths.reshape(-1), q, *([k_pages] * (hb * ppb)),
    *([v_pages] * (hb * ppb)))
  outs = list(outs)
  outs[1] = outs[1][..., 0]
  if return_weights:
    outs[3] = outs[3][..., 0]
  return outs


# ------------------------------------------------------------------ public wrapper


def _validate(q, k_pages, v_pages, page_table, lengths, block_sizes) -> None:
  """Raises ValueError, quoting the values, for any input the kernel cannot take."""
  for name, x, rank in (("q", q, 3), ("k_pages", k_pages, 3), ("v_pages", v_pages, 3),
                        ("page_table", page_table, 3), ("lengths", lengths, 2)):
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {x.shape}")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if x.dtype not in _DTYPES:
      raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages "
                     f"{v_pages.shape} {v_pages.dtype} must match")
  b, n, h = q.shape
  if k_pages.shape[2] != h:
    raise ValueError(f"head dim of q ({h}) and of k_pages/v_pages ({k_pages.shape[2]}) differ")
  if page_table.shape[0] != b:
    raise ValueError(f"page_table batch {page_table.shape[0]} != q batch {b}")
  kh = page_table.shape[1]
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of KV heads K={kh}")
  if page_table.dtype != jnp.int32:
    raise ValueError(f"page_table must be int32, got {page_table.dtype}")
  if lengths.shape != (b, kh):
    raise ValueError(f"lengths must have shape [B, K] = {(b, kh)}, got {lengths.shape}")
  if lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32, got {lengths.dtype}")
  if block_sizes is not None and not isinstance(block_sizes, PagedAttentionBlockSizes):
    raise ValueError(f"block_sizes must be a PagedAttentionBlockSizes or None, got {block_sizes!r}")
  if block_sizes is not None and kh % block_sizes.kv_heads_per_block:
    raise ValueError(f"kv_heads_per_block {block_sizes.kv_heads_per_block} must divide the "
                     f"KV heads K={kh}")


def _weights_from_blocks(w, w_max, lse, lengths, num_slots):
  """Softmax weights [B, N, S] from the kernel's block numerators.

  Block j of a head holds exp(logit - m_j), m_j being the running max when
  the block was visited, so its weights are those times exp(m_j - lse). This
  elementwise pass costs one read and write of [B, N, S], far less than a
  second pass over the keys.

  Args:
    w: [B, K, blocks, G, C]; w_max: [B, K, blocks, G]; lse: [B, K, G];
    lengths: [B, K]; num_slots: S (the unpadded slots per head).
  """
  b, kh, nb, g, c = w.shape
  w = w * jnp.exp(w_max - lse[:, :, None, :])[..., None]
  w = w.transpose(0, 1, 3, 2, 4).reshape(b, kh, g, nb * c)[..., :num_slots]
  valid = jnp.arange(num_slots)[None, None, :] < lengths[:, :, None]  # [B, K, S]
  # Slots past the length (and blocks the kernel skipped) hold garbage.
  return jnp.where(valid[:, :, None, :], w, 0.0).reshape(b, kh * g, num_slots)


@functools.partial(jax.jit, static_argnames=("block_sizes", "return_weights", "interpret",
                                             "target"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    block_sizes: PagedAttentionBlockSizes | None = None,
    return_weights: bool = False,
    interpret=False,
    target: str | None = None,
):
  """Paged decode attention as a Pallas kernel (same contract as the reference).

  Args:
    q: [B, N, H] float32 or bfloat16.
    k_pages, v_pages: [P, S_page, H] float32 or bfloat16 (the same).
    page_table: [B, K, P_max] int32, -1 = absent page.
    lengths: [B, K] int32 filled slots per head (at most P_max * S_page).
    block_sizes: pages per compute block (default: about 128 slots), KV
      heads per grid program (default 1) and, on GPU, programs per head
      (default: enough to fill the chip); ``PagedAttentionBlockSizes.get_default``.
    return_weights: also return the weights and the log-sum-exp.
    interpret: run the kernel body in Pallas' interpreter (CPU); a
      ``pltpu.InterpretParams`` selects TPU interpret mode.
    target: the platform whose compiled form to lower to ("gpu", "tpu"; None:
      the default device's); the interpreter runs either form on a CPU.

  Returns:
    out [B, N, H] in q's dtype; with ``return_weights`` also weights [B, N, S]
    float32 (zero on empty slots; S = P_max * S_page) and lse [B, N] float32
    (-inf for a head with no slots). A head of length 0 outputs zeros.

  The weights need the final normaliser, which one pass over the pages only
  knows at its end: the kernel writes each block's exp(logit - running max)
  and that max, and an elementwise XLA epilogue rescales them by
  exp(max - lse) (``_weights_from_blocks``), so the pages are still read once.
  """
  _validate(q, k_pages, v_pages, page_table, lengths, block_sizes)
  return _paged_attention(q, k_pages, v_pages, page_table, lengths, block_sizes=block_sizes,
                          return_weights=return_weights, interpret=interpret,
                          fetch=_page_fetch(interpret, target))


def _paged_attention(q, k_pages, v_pages, page_table, lengths, *, block_sizes, return_weights,
                     interpret, fetch):
  """``paged_attention`` on validated inputs in the given form ("pipelined" or "split")."""
  b, n, h = q.shape
  _, kh, p_max = page_table.shape
  page_size = k_pages.shape[1]
  if block_sizes is None:
    block_sizes = PagedAttentionBlockSizes.get_default(
        page_size, p_max, batch=b, kv_heads=kh,
        form=platform.TPU if fetch == "pipelined" else platform.GPU)
  ppb, hb = block_sizes.pages_per_block, block_sizes.kv_heads_per_block
  p_pad = pl.cdiv(p_max, ppb) * ppb
  table = jnp.pad(page_table, ((0, 0), (0, 0), (0, p_pad - p_max)), constant_values=-1)
  q = q.reshape(b, kh, n // kh, h)
  if fetch == "pipelined":
    if block_sizes.num_splits != 1:
      raise ValueError(f"the TPU (pipelined) form walks each head's blocks in one program: "
                       f"num_splits must be 1, got {block_sizes.num_splits}")
    outs = _call_pipelined(q, k_pages, v_pages, table, lengths, ppb=ppb, hb=hb,
                           return_weights=return_weights, interpret=interpret)
  else:
    outs = paged_attention_gpu.call_split(
        q, k_pages, v_pages, table, lengths, ppb=ppb, hb=hb,
        num_splits=block_sizes.num_splits, return_weights=return_weights, interpret=interpret)
  out = outs[0].reshape(b, n, h)
  if not return_weights:
    return out
  weights = _weights_from_blocks(outs[2], outs[3], outs[1], lengths, p_max * page_size)
  return out, weights, outs[1].reshape(b, n)
