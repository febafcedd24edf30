"""Causal GQA attention over a prompt: the blockwise XLA form, the float32 reference.

The native CPU kernel (``causal_attention_cpu.cc``, ``kvjax.kernels.native``)
computes the same; ``kvjax.cache.causal_attention`` picks one through
``kvjax.backend``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per query and key block of the prefill's causal attention. On a 2-core
# CPU, 512 prefilled SmolLM2 12-17% faster than 256 at 4K-8K tokens, with the
# same scratch memory (docs/results/vs_kvpress.md).
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
