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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  qg = q.astype(jnp.float32).reshape(b, k_heads, g, h)
  logits = jnp.einsum("bkgh,bksh->bkgs", qg, keys) * (h ** -0.5)
  valid = jnp.arange(keys.shape[2])[None, None, :] < lengths[:, :, None]  # [B, K, S]
  logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [B, K, G, 1]
  weights = jnp.where(valid[:, :, None, :], jnp.exp(logits - lse), 0.0)
  out = jnp.einsum("bkgs,bksh->bkgh", weights, values).reshape(b, n, h)
  out = out.astype(q.dtype)
  if not return_weights:
    return out
  return out, weights.reshape(b, n, -1), lse.reshape(b, n)
