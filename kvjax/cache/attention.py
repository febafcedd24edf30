"""The attention entry point: what a model's attention layer calls.

A Flax attention layer computes q, k, v (RoPE applied) and hands them here:

  cache, out = prefill_attention(cache, layer, q, k, v, positions, lengths, ex=ex)
  cache, out = decode_attention(cache, layer, q, k, v, positions, ex=ex)
  cache, out = chunk_attention(cache, layer, q, k, v, positions, lengths, select=select, ex=ex)

Prefill attends causally inside the prompt (blockwise: no T x T matrix per
head) and writes the prompt's keys and values into the cache, through an
optional ``select`` function that says which slot each token goes to (this is
where eviction policies plug in; the cache itself knows no policy). Decode
appends one token per sequence and attends over the paged cache. A chunked
prefill calls ``chunk_attention`` per chunk: attend, then compress the cached
entries and the chunk back into the cache.

``ex`` (a ``kvjax.execution.Execution``) says which implementation of each
kernel op runs and for which platform; generate's programs always pass
theirs. Left out (a user's own model), it is ``kvjax.execution.ambient()``:
XLA, or what ``kvjax.backend.use`` names.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax import execution
from kvjax.cache.paged import EMPTY, PagedKVCache, check_array, layer_window
from kvjax.kernels import causal_attention as causal_attention_lib
from kvjax.kernels.paged_attention import gather_pages


class Prompt(NamedTuple):
  """The prompt of a prefill, as a select function sees it."""

  tokens: jax.Array | None  # [B, T] int32 token ids (None if unknown)
  positions: jax.Array  # [B, T] int32
  lengths: jax.Array  # [B] int32 valid tokens per sequence (right padding after)


# select(layer, prompt, q, k, v) -> (slots [B, K, T] (-1 = drop), slot scores [B, K, T] | None).
SelectFn = Callable[..., tuple[jax.Array, jax.Array | None]]

# Tokens per query and key block of the prefill's causal attention (XLA form).
PREFILL_BLOCK = causal_attention_lib.PREFILL_BLOCK


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = PREFILL_BLOCK,
    ex: execution.Execution | None = None
) -> jax.Array:
  """Causal GQA attention over a right-padded prompt.

  q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H].

  The execution's ``causal_attention`` op (``kvjax.backend``): on CPU the
  native flash-attention kernel, elsewhere the blockwise XLA form
  (``kvjax.kernels.causal_attention.causal_attention_reference``, whose
  ``block`` sets the tiles; the native kernel has its own). Padding sits after
  each sequence's tokens, so the causal mask alone keeps valid queries clean.
  """
  return execution.of(ex).impl("causal_attention")(q, k, v, block=block)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int) -> jax.Array:
  """Causal GQA attention where each query sees its last ``window`` positions (itself included).

  q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H], positions 0..T-1,
  computed in float32 block by block: the queries of block c (``window``
  tokens) see the keys of blocks c-1 and c, so memory is O(T * window), not
  O(T^2). Right padding after a sequence's tokens is harmless, as for
  ``causal_attention``: no valid query sees a later position.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  w = min(window, t)
  blocks = -(-t // w)
  pad = blocks * w - t
  q32 = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  qb = q32.reshape(b, blocks, w, kv_heads, g, h)

  def key_blocks(x):  # [B, T, K, H] -> [B, C, 2W, K, H]: the previous block and this one
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (w, pad), (0, 0), (0, 0)))
    previous = x[:, :blocks * w].reshape(b, blocks, w, kv_heads, h)
    current = x[:, w:].reshape(b, blocks, w, kv_heads, h)
    return jnp.concatenate([previous, current], axis=2)

  kb, vb = key_blocks(k), key_blocks(v)
  scores = jnp.einsum("bcqkgh,bcskh->bckgqs", qb, kb) * (h ** -0.5)
  start = jnp.arange(blocks)[:, None, None] * w
  q_pos = start + jnp.arange(w)[None, :, None]  # [C, W, 1]
  k_pos = start - w + jnp.arange(2 * w)[None, None, :]  # [C, 1, 2W]
  allowed = (k_pos >= 0) & (k_pos <= q_pos) & (q_pos - k_pos < window)  # [C, W, 2W]
  scores = jnp.where(allowed[None, :, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bckgqs,bcskh->bcqkgh", probs, vb)
  return out.reshape(b, blocks * w, n, h)[:, :t].astype(q.dtype)


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                     local: bool | jax.Array = False, block: int = PREFILL_BLOCK,
                     ex: execution.Execution | None = None) -> jax.Array:
  """A prompt's causal attention, limited to each query's last ``window`` positions
  where ``local`` holds (a Python bool, or a traced one: a scanned layer's).

  q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H]: ``causal_attention``, or
  ``local_attention`` on local layers when the prompt is longer than the window.
  """
  def full(q, k, v):
    return causal_attention(q, k, v, block=block, ex=ex).astype(q.dtype)

  def windowed(q, k, v):
    return local_attention(q, k, v, window)

  if not window or q.shape[1] <= window or local is False:
    return full(q, k, v)
  if local is True:
    return windowed(q, k, v)
  return jax.lax.cond(local, windowed, full, q, k, v)


def _check_qkv(cache: PagedKVCache, q, k, v, positions, t: int | None = None) -> None:
  """Shape and dtype checks shared by the entry points (static: free under jit).

  Raises:
    ValueError: naming the argument, the expected [B, T, ...] shape and what came.
  """
  b, kh, h = cache.batch_size, cache.num_kv_heads, cache.k_pages.shape[-1]
  check_array("q", q, "[B, T, N, H]", (b, t, None, h), "float")
  t = q.shape[1]
  check_array("k", k, "[B, T, K, H]", (b, t, kh, h), "float")
  check_array("v", v, "[B, T, K, H]", (b, t, kh, h), "float")
  if q.shape[2] % kh:
    raise ValueError(f"query heads N={q.shape[2]} must be a multiple of the cache's "
                     f"KV heads K={kh}")
  check_array("positions", positions, "[B, T]", (b, t), "int")


def keep_all(layer, prompt: Prompt, q, k, v) -> jax.Array:
  """Slots that keep every prompt token: token t goes to slot t of every head."""
  del layer, q, v
  b, t, kh, _ = k.shape
  slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, kh, t))
  return jnp.where(slots < prompt.lengths[:, None, None], slots, EMPTY)


def _keep_all_select(layer, prompt, q, k, v):
  return keep_all(layer, prompt, q, k, v), None


def prefill_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    *,
    tokens: jax.Array | None = None,
    select: SelectFn = _keep_all_select,
    block: int = PREFILL_BLOCK,
    ex: execution.Execution | None = None,
) -> tuple[PagedKVCache, jax.Array]:
  """Attends over a prompt and stores what ``select`` keeps.

  Args:
    cache: the cache; pages for the kept slots are allocated here.
    layer: layer index (may be traced).
    q: [B, T, N, H]; k, v: [B, T, K, H]; positions: [B, T] int32.
    lengths: [B] int32 valid prompt tokens per sequence.
    tokens: [B, T] token ids, for select functions that look at the text.
    select: returns slots [B, K, T] per token per head (-1 = not kept) and
      optional per-slot scores to store (default: keep every token, which
      needs every head's capacity to be at least T). A select that keeps more
      than a head's capacity loses the excess (its length stops at capacity).
      A ring layer (``PagedKVCache.windows``) keeps its window of the prompt
      whatever ``select`` says, and its queries see only their window.
    block: block size of the causal attention.

  Returns:
    (cache with the layer written and its lengths set, out [B, T, N, H]).

  Raises:
    ValueError: a shape or dtype that does not match the cache, or a prompt
      longer than the smallest capacity when every token is kept.
  """
  _check_qkv(cache, q, k, v, positions)
  b, t = q.shape[:2]
  check_array("lengths", lengths, "[B]", (b,), "int")
  if tokens is not None:
    check_array("tokens", tokens, "[B, T]", (b, t), "int")
  smallest = min(c for row, w in zip(cache.capacity, cache.windows or (0,) * cache.num_layers)
                 for c in row if not w)
  if select is _keep_all_select and t > smallest:
    raise ValueError(
        f"prompt of {t} tokens does not fit the cache: keeping every token needs a "
        f"capacity of at least {t} per head, the smallest is {smallest}; pass a "
        f"select function that keeps fewer, or a larger capacity")
  out = prompt_attention(q, k, v, window=cache.ring_window, local=cache.is_ring(layer),
                         block=block, ex=ex)
  return store_prompt(cache, layer, Prompt(tokens, positions, lengths), q, k, v, select), out


def store_prompt(cache: PagedKVCache, layer, prompt: Prompt, q: jax.Array, k: jax.Array,
                 v: jax.Array, select: SelectFn) -> PagedKVCache:
  """Writes what ``select`` keeps of a prompt's keys and values into layer ``layer``.

  The storing half of ``prefill_attention``; a one-shot prefill's layers do
  not depend on what earlier layers kept, so a prompt's recorded q, k, v
  ([B, T, N, H], [B, T, K, H]) can be stored under several policies.
  """
  slots, scores = _select_or_ring(cache, layer, prompt, q, k, v, select)
  kept = (jnp.max(slots, axis=-1) + 1).astype(jnp.int32)  # [B, K]: slots fill from 0 upwards
  cache = cache.set_lengths(layer, kept)
  cache = cache.reserve(cache.lengths)
  return cache.write(layer, k, v, slots, prompt.positions, scores)


def _select_or_ring(cache: PagedKVCache, layer, prompt: Prompt, q, k, v, select: SelectFn):
  """``select``'s (slots, scores), or on a ring layer its window's slots (scores 0).

  A ring keeps its window whatever a policy would select, so the policy's
  scoring does not run there (a traced layer takes one branch of a cond): for
  H2O's accumulated attention that is most of a sliding-window model's prefill.
  """
  ring = cache.is_ring(layer) if cache.ring_window else False
  if ring is False:
    return select(layer, prompt, q, k, v)

  def ring_slots():
    slots = _ring_slots(prompt.positions, prompt.lengths, cache.ring_window, k.shape[2])
    return slots, jnp.zeros(slots.shape, jnp.float32)

  def selected():
    slots, scores = select(layer, prompt, q, k, v)
    return slots, jnp.zeros(slots.shape, jnp.float32) if scores is None else scores

  return ring_slots() if ring is True else jax.lax.cond(ring, ring_slots, selected)


def _ring_slots(positions: jax.Array, lengths: jax.Array, window: int, kv_heads: int
                ) -> jax.Array:
  """[B, K, T] a ring's slots for tokens at ``positions`` [B, T] (the first
  ``lengths`` [B] valid): the last ``window`` of them, position p at slot p % window."""
  j = jnp.arange(positions.shape[1])[None]
  kept = (j < lengths[:, None]) & (j >= lengths[:, None] - window)
  slots = jnp.where(kept, positions % window, EMPTY).astype(jnp.int32)
  return jnp.broadcast_to(slots[:, None], (slots.shape[0], kv_heads, slots.shape[1]))


def extend_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
) -> tuple[PagedKVCache, jax.Array]:
  """Appends a chunk of tokens to a filled cache, attending to it and to itself.

  Each chunk token sees every cached entry of its head (all of them precede
  the chunk) and the chunk tokens up to itself. Nothing is evicted.

  Args:
    q: [B, C, N, H]; k, v: [B, C, K, H]; positions: [B, C] int32.
    lengths: [B] int32 valid chunk tokens per sequence (right padding after).

  Returns:
    (cache with the chunk appended, out [B, C, N, H]). A head without room
    for the whole chunk keeps what fits (its length stops at capacity).
  """
  _check_qkv(cache, q, k, v, positions)
  check_array("lengths", lengths, "[B]", (q.shape[0],), "int")
  return _append_and_attend(cache, layer, q, k, v, positions, lengths)


def _append_and_attend(cache, layer, q, k, v, positions, lengths):
  """``extend_attention`` without the checks."""
  c = q.shape[1]
  _, cached = cache.layer_view(layer)
  valid = jnp.arange(c)[None, :] < lengths[:, None]  # [B, C]
  slots = jnp.where(valid[:, None, :], cached[..., None] + jnp.arange(c), EMPTY)  # [B, K, C]
  new_lengths = cached + lengths[:, None]
  if not cache.ring_window:
    cache = cache.set_lengths(layer, new_lengths)
    cache = cache.reserve(cache.lengths)
    cache = cache.write(layer, k, v, slots, positions)
    # The chunk is written first and the cached entries read after, from the
    # written pools (the write leaves slots below `cached` as they were): with
    # every read after the write, XLA updates the pools in place. Read first,
    # the pools were copied instead, both of them in every layer (2 x 36 MB a
    # layer for SmolLM2 at budget 1024 in a chunked prefill).
    table, _ = cache.layer_view(layer)
    stored = (gather_pages(cache.k_pages, table), gather_pages(cache.v_pages, table))
    return cache, _attend_cached_and_chunk(q, k, v, *stored, cached)
  # A ring's chunk overwrites entries its earlier tokens still see: read first.
  table, _ = cache.layer_view(layer)
  stored = [gather_pages(pool, table) for pool in (cache.k_pages, cache.v_pages, cache.positions)]
  ring, w = cache.is_ring(layer), cache.ring_window
  out = _attend_cached_and_chunk(q, k, v, stored[0], stored[1], cached,
                                 window=(jnp.where(ring, w, 0), stored[2], positions))
  cache = cache.set_lengths(layer, jnp.where(ring, jnp.minimum(new_lengths, w), new_lengths))
  cache = cache.reserve(cache.lengths)
  cache = cache.write(layer, k, v, jnp.where(ring, _ring_slots(positions, lengths, w, k.shape[2]),
                                             slots), positions)
  return cache, out


def _attend_cached_and_chunk(q, k, v, stored_k, stored_v, cached, window=None):
  """A chunk's attention over each head's first ``cached`` [B, K] stored entries
  ([B, K, S, H]) and, causally, over the chunk (q [B, C, N, H], k, v [B, C, K, H]).

  ``window``: None, or (W (0: none; may be traced), the stored entries' positions
  [B, K, S], the chunk's positions [B, C]): each query then sees only the
  keys less than W positions before it (a sliding-window layer's).

  Returns out [B, C, N, H] in q's dtype.
  """
  b, c, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  keys, values = stored_k.astype(jnp.float32), stored_v.astype(jnp.float32)
  # A KV head's G query heads are folded into the rows ([B, K, G*C, H]), so each
  # product is one batched matmul over (B, K) with no transpose: with the query
  # heads as an axis of their own this took 4x as long on a CPU.
  qg = (q.astype(jnp.float32) * (h ** -0.5)).reshape(b, c, kh, g, h).transpose(
      0, 2, 3, 1, 4).reshape(b, kh, g * c, h)
  chunk_k = jnp.swapaxes(k.astype(jnp.float32), 1, 2)  # [B, K, C, H]
  chunk_v = jnp.swapaxes(v.astype(jnp.float32), 1, 2)
  filled = jnp.arange(keys.shape[2]) < cached[..., None]  # [B, K, S]: the entries before the chunk
  # Slots past a head's length may hold anything (another sequence's page 0 for
  # absent pages): a zero weight would not cancel a NaN or Inf value there.
  values = jnp.where(filled[..., None], values, 0.0)
  out = _attend_rows(qg, keys, values, filled, chunk_k, chunk_v, window)
  out = out.reshape(b, kh, g, c, h).transpose(0, 3, 1, 2, 4)  # [B, C, K, G, H]
  return out.reshape(b, c, n, h).astype(q.dtype)


# Query rows per block of ``_attend_rows``: its logits are [B, K, rows, S + C] at
# a time. All rows at once, a 512-token chunk of SmolLM2 over 1,536 slots held
# 2 x 27 MiB of logits and weights (the chunk program's largest scratch). 128
# rather than 256: the chunk program's scratch 15.0 -> 12.2 MiB (SmolLM2, budget
# 1024), an 8K chunked prefill 21.7 vs 22.0 s (best of 3, in one process).
ATTEND_ROWS = 128


def _attend_rows(qg, keys, values, filled, chunk_k, chunk_v, window=None):
  """Rows of queries over a head's cached entries and, causally, its chunk.

  Args:
    qg: [B, K, G*C, H] float32 scaled queries, row g*C + t is query head g of chunk token t.
    keys, values: [B, K, S, H] float32 cached entries (values zero where not filled).
    filled: [B, K, S] bool, the entries that precede the chunk.
    chunk_k, chunk_v: [B, K, C, H] float32, the chunk's own keys and values.
    window: None, or (W, stored positions, chunk positions) as ``_attend_cached_and_chunk``.

  Returns:
    [B, K, G*C, H] float32, computed ``ATTEND_ROWS`` rows at a time.
  """
  b, kh, m, h = qg.shape
  c = chunk_k.shape[2]
  rows = min(ATTEND_ROWS, m)
  blocks = -(-m // rows)
  qb = jnp.pad(qg, ((0, 0), (0, 0), (0, blocks * rows - m), (0, 0)))
  qb = jnp.moveaxis(qb.reshape(b, kh, blocks, rows, h), 2, 0)  # [blocks, B, K, rows, H]

  def block(args):
    q, i = args
    token = (i * rows + jnp.arange(rows)) % c  # each row's chunk token (padding: any)
    seen = filled[:, :, None]  # [B, K, 1, S]
    causal = token[:, None] >= jnp.arange(c)[None]  # [rows, C]
    if window is not None:
      w, stored_pos, chunk_pos = window
      reach = jnp.where(w > 0, w, jnp.iinfo(jnp.int32).max)
      q_pos = chunk_pos[:, token]  # [B, rows]
      seen = seen & (q_pos[:, None, :, None] - stored_pos[:, :, None, :] < reach)
      causal = causal & (token[:, None] - jnp.arange(c)[None] < reach)
    old = jnp.where(seen, jnp.einsum("bkmh,bksh->bkms", q, keys), -jnp.inf)
    new = jnp.where(causal, jnp.einsum("bkmh,bkch->bkmc", q, chunk_k), -jnp.inf)
    # One softmax over [old, new] without concatenating them; each row sees its
    # own token, so the max is finite.
    top = jnp.maximum(old.max(-1), new.max(-1))[..., None]
    p_old, p_new = jnp.exp(old - top), jnp.exp(new - top)
    out = (jnp.einsum("bkms,bksh->bkmh", p_old, values)
           + jnp.einsum("bkmc,bkch->bkmh", p_new, chunk_v))
    return out / (p_old.sum(-1) + p_new.sum(-1))[..., None]

  out = jax.lax.map(block, (qb, jnp.arange(blocks)))  # [blocks, B, K, rows, H]
  return jnp.moveaxis(out, 0, 2).reshape(b, kh, blocks * rows, h)[:, :, :m]


def chunk_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    *,
    select: SelectFn = _keep_all_select,
    ex: execution.Execution | None = None,
) -> tuple[PagedKVCache, jax.Array]:
  """One chunk of a chunked prefill: attend to the cache and the chunk, then compress.

  Every chunk token sees each cached entry of its head and the chunk up to
  itself. Then each head is compressed: ``select`` sees the head's cached
  entries followed by the chunk's tokens as a dense prompt of its own (one
  sequence per (sequence, KV head), in slot order, with their original
  positions, the chunk's queries on the chunk's slots and zero queries
  elsewhere), and the entries it keeps are written to the head's first slots,
  in that order; pages past them are freed (``PagedKVCache.store_kept``: the
  backend's ``compact_slots`` op, storing from the dense entries). The chunk's
  keys and values never enter the pool before compression, so the pool needs
  room for what the policy keeps only: the chunk lives in the program's
  scratch, a layer at a time.

  A ring layer (``PagedKVCache.windows``) takes no policy: its queries see
  their window, and it keeps the newest W positions, each at its slot.

  Policies that score from an observation window inside the chunk (the last
  queries before each head's length) or from the keys and values see what
  they would see in a one-shot prefill, restricted to the entries still cached.

  Args:
    q: [B, C, N, H]; k, v: [B, C, K, H]; positions: [B, C] int32.
    lengths: [B] int32 valid chunk tokens (0: the sequence has ended; its
      heads are left as they are).
    select: the policy's prefill keep rule (``Policy.select``), built for an
      execution whose reductions are local (``Execution.local``): it sees
      each (sequence, KV head) as a one-head sequence of its own.

  Returns:
    (cache with each head compressed over its entries and the chunk, out [B, C, N, H]).
  """
  _check_qkv(cache, q, k, v, positions)
  check_array("lengths", lengths, "[B]", (q.shape[0],), "int")
  table, cached = cache.layer_view(layer)
  stored = [gather_pages(pool, table) for pool in  # [B, K, S, ...]
            (cache.k_pages, cache.v_pages, cache.positions, cache.scores)]
  ring, w = cache.is_ring(layer), cache.ring_window
  window = (jnp.where(ring, w, 0), stored[2], positions) if w else None
  out = _attend_cached_and_chunk(q, k, v, stored[0], stored[1], cached, window)

  entries = _union(stored, k, v, positions, cached)
  keep = _select_union(layer, select, q, entries, cached, lengths)
  if not w:
    return cache.store_kept(layer, keep, entries, ex=ex), out
  # A ring keeps its entries where they are and takes the chunk's last W tokens
  # at their positions' slots, over the entries that leave the window.
  keep = jnp.where(ring, jnp.arange(keep.shape[-1]) < cached[..., None], keep)
  cache = cache.store_kept(layer, keep, entries, ex=ex)
  _, kept_lengths = cache.layer_view(layer)
  total = cached + lengths[:, None]
  cache = cache.set_lengths(layer, jnp.where(ring, jnp.minimum(total, w), kept_lengths))
  cache = cache.reserve(cache.lengths)
  ring_slots = _ring_slots(positions, lengths, w, k.shape[2])
  return cache.write(layer, k, v, jnp.where(ring, ring_slots, EMPTY), positions), out


def _union(stored, k, v, positions, cached) -> tuple[jax.Array, ...]:
  """Each head's cached entries followed by the chunk's tokens, densely.

  Args:
    stored: (keys, values [B, K, S, H], positions, scores [B, K, S]) as read.
    k, v: [B, C, K, H] the chunk's; positions: [B, C]; cached: [B, K] entries held.

  Returns:
    (keys, values [B, K, U, H], positions, scores [B, K, U]), U = S + C: slots
    below ``cached`` hold the head's entries, the next ones the chunk's tokens.
  """
  b, c, kh, _ = k.shape
  s = stored[0].shape[2]
  u = s + c
  slot = jnp.arange(u)
  src = jnp.where(slot < cached[..., None], slot, s + slot - cached[..., None])
  src = jnp.clip(src, 0, u - 1)  # an index into [stored, chunk]
  chunk = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
           jnp.broadcast_to(positions[:, None, :], (b, kh, c)), jnp.zeros((b, kh, c)))

  def union(x, y):
    both = jnp.concatenate([x, y.astype(x.dtype)], axis=2)
    return jnp.take_along_axis(both, src.reshape(src.shape + (1,) * (both.ndim - 3)), axis=2)

  return tuple(map(union, stored, chunk))


def _select_union(layer, select: SelectFn, q, entries, cached, lengths) -> jax.Array:
  """bool [B, K, U]: the entries of each head's union (``_union``) that ``select`` keeps.

  ``select`` sees each (sequence, KV head) as a one-head prompt of U slots,
  the chunk's queries q [B, C, N, H] on the chunk's slots and zeros elsewhere.
  """
  union_k, union_v, union_pos, _ = entries
  b, c, n, h = q.shape
  kh, u = union_k.shape[1], union_k.shape[2]
  slot = jnp.arange(u)
  total = cached + lengths[:, None]  # [B, K]
  # Gathered rather than scattered into zeros: XLA fuses the gather into the
  # policy's reads (a window's rows), and the [B*K, U, G, H] array is not
  # materialized (twice, with the scatter's transposed copy: 2 x 3.4 MiB of
  # scratch for SmolLM2 at budget 1024).
  qg = jnp.swapaxes(q.reshape(b, c, kh, n // kh, h), 1, 2)  # [B, K, C, G, H]
  q_index = slot - cached[..., None]  # [B, K, U]: the chunk token on each slot
  on_chunk = (q_index >= 0) & (q_index < lengths[:, None, None])
  dense_q = jnp.take_along_axis(qg, jnp.clip(q_index, 0, c - 1)[..., None, None], axis=2)
  dense_q = jnp.where(on_chunk[..., None, None], dense_q, 0).reshape(b * kh, u, n // kh, h)
  head_lengths = total.reshape(b * kh)
  slot_pos = jnp.where(slot < head_lengths[:, None], union_pos.reshape(b * kh, u), 0)
  kept, _ = select(layer, Prompt(None, slot_pos, head_lengths),
                   dense_q, union_k.reshape(b * kh, u, 1, h), union_v.reshape(b * kh, u, 1, h))
  keep = (kept[:, 0] >= 0).reshape(b, kh, u) & (slot < total[..., None])
  # A sequence without new tokens keeps everything (its heads did not change).
  return jnp.where((lengths > 0)[:, None, None], keep, slot < cached[..., None])


def decode_attention(
    cache: PagedKVCache,
    layer,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    accumulate: bool = False,
    slots: jax.Array | None = None,
    active: jax.Array | None = None,
    ex: execution.Execution | None = None,
) -> tuple[PagedKVCache, jax.Array]:
  """Appends one token per sequence, then attends over the layer's pages.

  The attention is the execution's ``paged_attention`` op.

  Args:
    q: [B, 1, N, H]; k, v: [B, 1, K, H]; positions: [B, 1] int32.
    accumulate: add the attention each slot receives (mean over the query
      heads of its KV head) to ``cache.scores`` (H2O-style policies).
    slots: [B, K] int32 the layer's part of ``PagedKVCache.open_token_slots``,
      when the step opened every layer's slot already (position and length
      set): only the key and value are stored. None: ``append`` does it all.
    active: bool [B], the sequences whose attention counts towards ``cache.scores``
      (None: all): a serving engine's idle or half-prefilled slots add nothing.

  Returns:
    (cache, out [B, 1, N, H]).
  """
  _check_qkv(cache, q, k, v, positions, t=1)
  if slots is None:
    cache = cache.append(layer, k, v, positions)
  else:
    cache = cache.write_token(layer, k, v, slots)
  table, lengths = cache.layer_view(layer)
  attend = execution.of(ex).impl("paged_attention")
  if not accumulate:
    out = attend(q[:, 0], cache.k_pages, cache.v_pages, table, lengths)
    return cache, out[:, None]
  out, weights, _ = attend(q[:, 0], cache.k_pages, cache.v_pages, table, lengths,
                           return_weights=True)
  b, n, s = weights.shape
  kh = table.shape[1]
  received = weights.reshape(b, kh, n // kh, s).mean(2)  # [B, K, S]
  # Whole pages at once: weights are zero past a head's length, and absent pages
  # (-1) are dropped.
  taken = table >= 0 if active is None else (table >= 0) & active[:, None, None]
  page = jnp.where(taken, table, cache.num_pages)  # [B, K, P_max]
  received = received.reshape(table.shape + (cache.page_size,))
  cache = cache.replace(scores=cache.scores.at[page].add(received, mode="drop"))
  return cache, out[:, None]
