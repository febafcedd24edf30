"""The attention entry point: what a model's attention layer calls.

A Flax attention layer computes q, k, v (RoPE applied) and hands them here:

  cache, out = prefill_attention(cache, layer, q, k, v, positions, lengths)
  cache, out = decode_attention(cache, layer, q, k, v, positions)

Prefill attends causally inside the prompt (query-chunked: no T x T matrix per
head) and writes the prompt's keys and values into the cache, through an
optional ``select`` function that says which slot each token goes to (this is
where eviction policies plug in; the cache itself knows no policy). Decode
appends one token per sequence and attends over the paged cache.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvjax import backend as backend_lib
from kvjax.cache.paged import EMPTY, PagedKVCache

# select(layer, q, k, v, positions, lengths) -> slots [B, K, T] (-1 = drop).
SelectFn = Callable[..., jax.Array]


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_chunk: int = 512
) -> jax.Array:
  """Causal GQA attention over a right-padded prompt, chunked over queries.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] (RoPE applied). Padding sits after each
      sequence's tokens, so the causal mask alone keeps valid queries clean.
    q_chunk: queries per chunk; peak logits are [B, N, q_chunk, T].

  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  c = min(q_chunk, t)
  t_pad = -(-t // c) * c
  qg = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))).reshape(b, t_pad // c, c, kh, g, h)
  key_pos = jnp.arange(t)

  def one_chunk(i_and_q):
    i, q_c = i_and_q  # q_c: [B, C, K, G, H]
    logits = jnp.einsum("bckgh,btkh->bkgct", q_c, k, preferred_element_type=jnp.float32)
    logits = logits * (h ** -0.5)
    query_pos = i * c + jnp.arange(c)
    mask = key_pos[None, :] <= query_pos[:, None]  # [C, T]
    logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgct,btkh->bckgh", weights.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)

  chunks = jnp.swapaxes(qg, 0, 1)  # [T/C, B, C, K, G, H]
  out = jax.lax.map(one_chunk, (jnp.arange(t_pad // c), chunks))
  out = jnp.swapaxes(out, 0, 1).reshape(b, t_pad, n, h)[:, :t]
  return out.astype(q.dtype)


def keep_all(layer, q, k, v, positions, lengths) -> jax.Array:
  """The full policy's select: token t goes to slot t of every head."""
  del layer, q, v, positions
  b, t, kh, _ = k.shape
  slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, kh, t))
  return jnp.where(slots < lengths[:, None, None], slots, EMPTY)


def prefill_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    *,
    select: SelectFn = keep_all,
    q_chunk: int = 512,
) -> tuple[PagedKVCache, jax.Array]:
  """Attends over a prompt and stores what ``select`` keeps.

  Args:
    cache: the cache; pages for the kept slots are allocated here.
    layer: layer index (may be traced).
    q: [B, T, N, H]; k, v: [B, T, K, H]; positions: [B, T] int32.
    lengths: [B] int32 valid prompt tokens per sequence.
    select: returns slots [B, K, T] per token per head (-1 = not kept).

  Returns:
    (cache with the layer written and its lengths set, out [B, T, N, H]).
  """
  out = causal_attention(q, k, v, q_chunk=q_chunk)
  slots = select(layer, q, k, v, positions, lengths)
  kept = (jnp.max(slots, axis=-1) + 1).astype(jnp.int32)  # [B, K]: slots fill from 0 upwards
  cache = cache.set_lengths(layer, kept)
  cache = cache.reserve(cache.lengths)
  return cache.write(layer, k, v, slots, positions), out


def decode_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    backend: str = "xla",
) -> tuple[PagedKVCache, jax.Array]:
  """Appends one token per sequence, then attends over the layer's pages.

  Args:
    q: [B, 1, N, H]; k, v: [B, 1, K, H]; positions: [B, 1] int32.
    backend: "xla" or "pallas" (see kvjax.backend).

  Returns:
    (cache, out [B, 1, N, H]).
  """
  cache = cache.append(layer, k, v, positions)
  table, lengths = cache.layer_view(layer)
  attend = backend_lib.paged_attention_fn(backend)
  out = attend(q[:, 0], cache.k_pages, cache.v_pages, table, lengths)
  return cache, out[:, None]
