"""Causal GQA attention over a prompt: the blockwise XLA form (the float32
reference) and the fused form that runs the chip's attention kernels.

The fused form (``causal_attention_fused``: cuDNN on NVIDIA GPUs, JAX's
Pallas flash kernel on TPU) and the native CPU kernel
(``causal_attention_cpu.cc``, ``kvjax.kernels.native``) compute the same;
``kvjax.cache.causal_attention`` picks one through ``kvjax.backend``.
"""

from __future__ import annotations

import jax
from jax.extend import backend as jax_backend
import jax.numpy as jnp

from kvjax.kernels import platform

# Tokens per query and key block of the prefill's causal attention: the faster
# of the sizes timed on a CPU, at the same scratch memory (docs/results/vs_kvpress.md).
PREFILL_BLOCK = 512


def causal_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = PREFILL_BLOCK
) -> jax.Array:
  """Causal GQA attention over a right-padded prompt, blockwise (flash-style), in XLA.

  Queries and keys are cut into blocks of ``block`` tokens; each query block
  visits only the key blocks at or before it, with an online softmax, so no
  T x T matrix exists and the masked upper triangle costs nothing.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] (RoPE applied). Padding sits after each
      sequence's tokens, so the causal mask alone keeps valid queries clean.
    block: tokens per query and key block; peak logits are [B, N, block, block].

  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  c = min(block, t)
  num_blocks = -(-t // c)
  pad = ((0, 0), (0, num_blocks * c - t), (0, 0), (0, 0))
  # Blocks lead, and a KV head's G query heads are folded into the query rows
  # ([NB, B, K, G*C, H]), so each step is one batched matmul over (B, K) with
  # no transpose inside the loops: on a CPU that is most of attention's cost.
  qb = (jnp.pad(q, pad).astype(jnp.float32) * (h ** -0.5)).reshape(
      b, num_blocks, c, kh, g, h).transpose(1, 0, 3, 4, 2, 5).reshape(num_blocks, b, kh, g * c, h)
  kb = jnp.pad(k, pad).reshape(b, num_blocks, c, kh, h).transpose(1, 0, 3, 2, 4)  # [NB, B, K, C, H]
  vb = jnp.pad(v, pad).reshape(b, num_blocks, c, kh, h).transpose(1, 0, 3, 2, 4)
  diagonal = jnp.tile(jnp.arange(c)[:, None] >= jnp.arange(c)[None, :], (g, 1))  # [G*C, C]

  def key_block(carry, qi, kj, vj, mask=None):
    running_max, denom, acc = carry
    logits = jnp.einsum("bkmh,bksh->bkms", qi, kj, preferred_element_type=jnp.float32)
    if mask is not None:
      logits = jnp.where(mask, logits, -jnp.inf)
    new_max = jnp.maximum(running_max, logits.max(-1))
    p = jnp.exp(logits - new_max[..., None])
    rescale = jnp.exp(running_max - new_max)
    denom = denom * rescale + p.sum(-1)
    acc = acc * rescale[..., None] + jnp.einsum("bkms,bksh->bkmh", p, vj,
                                                preferred_element_type=jnp.float32)
    return new_max, denom, acc

  def query_block(i, blocks):
    qi = blocks[i]  # [B, K, G*C, H]
    init = (jnp.full((b, kh, g * c), -jnp.inf), jnp.zeros((b, kh, g * c)),
            jnp.zeros((b, kh, g * c, h)))
    # Key blocks before the diagonal need no mask; the diagonal block comes last.
    carry = jax.lax.fori_loop(0, i, lambda j, carry: key_block(carry, qi, kb[j], vb[j]), init)
    _, denom, acc = key_block(carry, qi, kb[i], vb[i], diagonal)
    # Block i's output takes the place of its queries, which nothing reads
    # again: no output buffer (whose zero-filling XLA would be free to hoist
    # to the start of an unrolled model, one per layer, all alive at once).
    return blocks.at[i].set(acc / denom[..., None])

  out = jax.lax.fori_loop(0, num_blocks, query_block, qb)  # [NB, B, K, G*C, H]
  out = out.reshape(num_blocks, b, kh, g, c, h).transpose(1, 0, 4, 2, 3, 5)
  return out.reshape(b, num_blocks * c, n, h)[:, :t].astype(q.dtype)


# The fused form's implementations (``fused_form``).
CUDNN = "cudnn"
TPU_FLASH = "tpu_flash"
XLA = "xla"

# Rows (and columns) of the TPU flash kernel's tiles, largest first: the first
# that divides the prompt, padded to a multiple of the last, is used.
TPU_FLASH_BLOCKS = (512, 256, 128)


def fused_form(q: jax.Array, target: str | None = None) -> str:
  """Which implementation ``causal_attention_fused`` traces for queries like ``q``.

  cuDNN's flash attention on an NVIDIA GPU for bfloat16 / float16 with a head
  dim that is a multiple of 8 up to 128; JAX's Pallas flash kernel on TPU (or
  when ``pltpu.force_tpu_interpret_mode()`` is active); otherwise XLA over
  blocks of queries. ``target``: the platform built for (None: the default
  device's).
  """
  if platform.resolve_target(target) == "tpu" or platform.tpu_interpret_forced():
    return TPU_FLASH
  h = q.shape[-1]
  if (_on_cuda() and jnp.dtype(q.dtype) in (jnp.bfloat16, jnp.float16)
      and h % 8 == 0 and h <= 128):
    return CUDNN
  return XLA


def _on_cuda() -> bool:
  """An NVIDIA GPU is the default device (cuDNN needs one when it is traced)."""
  if jax.default_backend() != "gpu":
    return False
  # The check jax's cuDNN front end makes itself (ROCm names "rocm" there).
  return "cuda" in jax_backend.get_backend().platform_version


def causal_attention_fused(
    q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = PREFILL_BLOCK,
    target: str | None = None
) -> jax.Array:
  """Causal GQA attention over a right-padded prompt in one fused attention per layer.

  Computes what ``causal_attention_reference`` defines, through the chip's
  attention kernels (``fused_form``):
    cuDNN      ``jax.nn.dot_product_attention(..., implementation="cudnn")``:
               a flash kernel that skips the masked upper triangle. Named
               explicitly: ``implementation=None`` is XLA's dense form in jax
               0.10 and 0.11 alike, a [B, N, T, T] float32 matrix.
    TPU flash  ``jax.experimental.pallas.ops.tpu.flash_attention`` (MHA: each
               KV head repeated for its G query heads), the prompt padded at
               the end to the tile.
    XLA        ``jax.nn.dot_product_attention(..., implementation="xla")`` for
               ``block`` queries at a time over every key, masked: one loop
               body, [B, N, block, T] logits at a time, operands in their own
               dtype (bfloat16 products accumulate in float32).

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] (RoPE applied), K dividing N. Padding
      sits after each sequence's tokens: the causal mask alone keeps valid
      queries clean (a padded row may see padded keys; nothing reads it).
    block: query rows per step of the XLA form (the kernels have their own tiles).
    target: the platform built for (None: the default device's).

  Returns:
    [B, T, N, H] in q's dtype.
  """
  form = fused_form(q, target)
  if form == CUDNN:
    try:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except (NotImplementedError, RuntimeError):
      pass  # cuDNN missing or too old for the shape: raised while tracing, before any op
  if form == TPU_FLASH:
    return _tpu_flash(q, k, v)
  return _xla_query_blocks(q, k, v, block=block)


def _xla_query_blocks(q, k, v, *, block):
  """The XLA form of ``causal_attention_fused``: queries in blocks, keys whole."""
  b, t, n, h = q.shape
  if t <= block:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  num_blocks = -(-t // block)
  qb = jnp.pad(q, ((0, 0), (0, num_blocks * block - t), (0, 0), (0, 0)))
  qb = jnp.moveaxis(qb.reshape(b, num_blocks, block, n, h), 1, 0)  # [NB, B, C, N, H]

  def query_block(args):
    qi, i = args
    rows = i * block + jnp.arange(block)
    mask = (rows[:, None] >= jnp.arange(t)[None, :])[None, None]  # [1, 1, C, T]
    return jax.nn.dot_product_attention(qi, k, v, mask=mask, implementation="xla")

  out = jax.lax.map(query_block, (qb, jnp.arange(num_blocks)))  # [NB, B, C, N, H]
  return jnp.moveaxis(out, 0, 1).reshape(b, num_blocks * block, n, h)[:, :t]


def _tpu_flash(q, k, v):
  """The TPU form of ``causal_attention_fused``: JAX's Pallas flash kernel (Mosaic)."""
  # Imported here: the TPU Pallas modules load only when a TPU kernel is built.
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # pylint: disable=g-import-not-at-top
  b, t, n, h = q.shape
  g = n // k.shape[2]
  smallest = TPU_FLASH_BLOCKS[-1]
  t_pad = -(-t // smallest) * smallest
  tile = next(c for c in TPU_FLASH_BLOCKS if t_pad % c == 0)
  # Padding goes after the prompt, where the causal mask hides it from every real query.
  pad = ((0, 0), (0, t_pad - t), (0, 0), (0, 0))
  heads_first = lambda x: jnp.pad(x, pad).transpose(0, 2, 1, 3)  # [B, heads, T_pad, H]
  keys, values = (heads_first(jnp.repeat(x, g, axis=2)) for x in (k, v))
  sizes = tpu_flash.BlockSizes(block_q=tile, block_k_major=tile, block_k=tile, block_b=1)
  out = tpu_flash.flash_attention(heads_first(q), keys, values, causal=True,
                                  sm_scale=h ** -0.5, block_sizes=sizes)
  return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)
