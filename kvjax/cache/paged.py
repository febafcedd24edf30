"""PagedKVCache: one fixed-shape page pool shared by every (sequence, layer, KV head).

A page holds ``page_size`` consecutive slots of a single (sequence, layer, KV
head). Each head owns at most ``capacity[l][k] // page_size`` pages; the pool
holds exactly the pages the capacities need (fewer for a policy whose heads
share a layer's budget unevenly: AdaKV), so a smaller budget is a smaller
pool (real memory, not a mask). Pages are taken from a free stack when a head
grows past a page boundary and are given back when a policy frees them.

A layer may be a ring (``windows``): a sliding-window layer (Gemma 3's local
layers) whose heads hold their last W positions, position p in slot p % W, so
the newest token overwrites the one that just left the window. Its capacity
is the window (at most), it takes no policy and never evicts; attention over
it needs no mask, since it holds exactly the keys a query may see.

Every shape depends only on static Python ints (batch, capacities, page size),
so jitted prefill and decode compile once per configuration.

This module allocates pages and writes tokens; the evictions' bodies are in
``kvjax.cache.eviction``, the shape checks and capacity helpers in
``kvjax.cache.shapes`` (their names are importable from here too).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import execution
from kvjax.cache import eviction
# EMPTY, the checks and round_up are also imported from here by other modules.
from kvjax.cache.shapes import EMPTY
from kvjax.cache.shapes import capacity_table as _capacity_table
from kvjax.cache.shapes import check_array
from kvjax.cache.shapes import check_layer
from kvjax.cache.shapes import check_windows
from kvjax.cache.shapes import layer_window
from kvjax.cache.shapes import pages_owned
from kvjax.cache.shapes import round_up


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_arrays(num_pages: int, page_size: int, head_dim: int, dtype, table_shape) -> dict:
  """The arrays of an empty cache (``table_shape`` = [B, L, K, P_max]), made by one program.

  Made eagerly, each array compiled a program of its own (eight per cache
  shape), and on a CPU each compiled program holds ~1.5 MiB of host memory
  for the rest of the process.
  """
  return dict(
      k_pages=jnp.zeros((num_pages, page_size, head_dim), dtype),
      v_pages=jnp.zeros((num_pages, page_size, head_dim), dtype),
      positions=jnp.full((num_pages, page_size), EMPTY, jnp.int32),
      scores=jnp.zeros((num_pages, page_size), jnp.float32),
      page_table=jnp.full(table_shape, EMPTY, jnp.int32),
      lengths=jnp.zeros(table_shape[:3], jnp.int32),
      # Popped from the end: page 0 is handed out first.
      free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
      num_free=jnp.asarray(num_pages, jnp.int32),
  )


@struct.dataclass
class PagedKVCache:
  """Fixed-shape paged KV state.

  Attributes:
    k_pages: [P, S_page, H] key pool.
    v_pages: [P, S_page, H] value pool.
    positions: [P, S_page] int32 original token position of each slot (-1 empty).
    scores: [P, S_page] float32 per-slot statistic kept by policies that need one
      (e.g. the attention a slot has received, for H2O); zero otherwise.
    page_table: [B, L, K, P_max] int32 page ids per head, -1 where not allocated.
    lengths: [B, L, K] int32 filled slots per head.
    free_pages: [P] int32 stack of free page ids; the first ``num_free`` are free.
    num_free: [] int32.
    page_size: S_page (static).
    capacity: slots each (layer, KV head) may hold, [L][K] (static).
    shards: (data shards, model shards) of a cache laid over a device mesh
      (``kvjax.sharding.empty_cache``), (1, 1) otherwise (static). On a mesh
      the pools are cut into equal blocks of pages, one per device; a head's
      pages lie in its device's block and its page ids, free stack and
      ``num_free`` (then [devices]) are that block's own.
    windows: per layer, W of a ring layer (see the module docstring), 0 for a
      layer that holds what its policy keeps; () when no layer is a ring (static).
  """

  k_pages: jax.Array
  v_pages: jax.Array
  positions: jax.Array
  scores: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  free_pages: jax.Array
  num_free: jax.Array
  page_size: int = struct.field(pytree_node=False)
  capacity: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)
  shards: tuple[int, int] = struct.field(pytree_node=False, default=(1, 1))
  windows: tuple[int, ...] = struct.field(pytree_node=False, default=())

  # ---------------------------------------------------------------- creation

  @classmethod
  def create(
      cls,
      *,
      batch_size: int,
      capacity: int | Sequence[int] | Sequence[Sequence[int]],
      num_layers: int,
      num_kv_heads: int,
      head_dim: int,
      page_size: int = 16,
      dtype=jnp.float32,
      pages_per_sequence: int | None = None,
      windows: Sequence[int] | None = None,
      num_pages: int | None = None,
  ) -> "PagedKVCache":
    """An empty cache.

    Args:
      batch_size: B.
      capacity: slots per head: one int for every (layer, KV head), a sequence
        of L ints (per layer), or L sequences of K ints (per layer and head).
        Each must be a positive multiple of ``page_size``.
      num_layers, num_kv_heads, head_dim: L, K, H.
      page_size: S_page, slots per page.
      dtype: dtype of keys and values.
      pages_per_sequence: the pool's pages per sequence; None: exactly what
        the capacities need. Fewer suit a policy that bounds its heads' total
        below the sum of their capacities (AdaKV: one budget per layer, shared
        unevenly by its heads); the caller guarantees the heads never need more.
      windows: None, or per layer the window W of a ring layer (0: not a ring).
        Every ring has the same W, a multiple of ``page_size``; a ring layer's
        capacity is at most W (less suits a run that never reaches W tokens).
      num_pages: the pool's pages in all, shared by every sequence (a serving
        engine's pool, sized in bytes, not batch x capacity); the caller
        admits no more than it holds. None: ``batch_size x pages_per_sequence``.
    """
    if not isinstance(page_size, int) or page_size <= 0:
      raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(batch_size, int) or batch_size <= 0:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    cap = _capacity_table(capacity, num_layers, num_kv_heads)
    for l, row in enumerate(cap):
      for k, c in enumerate(row):
        if c <= 0 or c % page_size:
          raise ValueError(
              f"capacity of layer {l}, KV head {k} is {c}: it must be a "
              f"positive multiple of page_size {page_size}")
    windows = check_windows(windows, cap, page_size)
    needed = sum(c // page_size for row in cap for c in row)
    p_max = max(c for row in cap for c in row) // page_size
    if pages_per_sequence is None:
      pages_per_sequence = needed
    elif (not isinstance(pages_per_sequence, int) or isinstance(pages_per_sequence, bool)
          or not p_max <= pages_per_sequence <= needed):
      raise ValueError(f"pages_per_sequence must be an int in [{p_max}, {needed}] (a head's "
                       f"pages, every head's), got {pages_per_sequence!r}")
    if num_pages is None:
      num_pages = batch_size * pages_per_sequence
    elif not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < p_max:
      raise ValueError(f"num_pages must be an int >= {p_max} (one head's pages), "
                       f"got {num_pages!r}")
    arrays = _empty_arrays(num_pages, page_size, head_dim, jnp.dtype(dtype),
                           (batch_size, num_layers, num_kv_heads, p_max))
    return cls(**arrays, page_size=page_size, capacity=cap, windows=windows)

  # ---------------------------------------------------------------- shapes

  @property
  def batch_size(self) -> int:
    return self.page_table.shape[0]

  @property
  def num_layers(self) -> int:
    return self.page_table.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.page_table.shape[2]

  @property
  def max_slots(self) -> int:
    """S: slots of the largest head, the width of per-head slot arrays."""
    return self.page_table.shape[3] * self.page_size

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[0]

  @property
  def kv_bytes(self) -> int:
    """Bytes allocated for keys and values (the page pool)."""
    return self.k_pages.nbytes + self.v_pages.nbytes

  @property
  def ring_window(self) -> int:
    """W of the ring layers (static), 0 when no layer is a ring."""
    return max(self.windows, default=0)

  def is_ring(self, layer) -> bool | jax.Array:
    """Whether ``layer`` is a ring: a Python bool for an int layer, a traced one otherwise."""
    return layer_window(self.windows, layer)[1]

  def capacity_array(self) -> jax.Array:
    """[L, K] int32 capacity per head (a constant)."""
    return jnp.asarray(np.array(self.capacity, np.int32))

  # ---------------------------------------------------------------- pages

  def reserve(self, new_lengths: jax.Array) -> "PagedKVCache":
    """Allocates pages so every head can hold ``new_lengths`` [B, L, K] slots.

    Heads that already own enough pages are unchanged. Asking for more than a
    head's capacity allocates up to its capacity (writes past it are dropped).
    """
    check_array("new_lengths", new_lengths, "[B, L, K]", self.lengths.shape, "int")
    ps = self.page_size
    cap = self.capacity_array()[None]  # [1, L, K]
    have = pages_owned(self.page_table)  # [B, L, K]
    want = jnp.maximum((jnp.minimum(new_lengths, cap) + ps - 1) // ps, have)
    j = jnp.arange(self.page_table.shape[-1])
    grow = (j >= have[..., None]) & (j < want[..., None])  # [B, L, K, P_max]
    return self.replace(
        page_table=jnp.where(grow, self._pop_free(grow), self.page_table),
        num_free=self.num_free - grow.sum(dtype=jnp.int32),
    )

  def _pop_free(self, grow: jax.Array) -> jax.Array:
    """The free pages that the True entries of ``grow`` take, in flat order, off the
    top of the free stack (an array of ``grow``'s shape; meaningless where False).
    The caller lowers ``num_free`` by ``grow``'s count."""
    rank = jnp.cumsum(grow.reshape(-1)).reshape(grow.shape) - 1
    return self.free_pages[jnp.clip(self.num_free - 1 - rank, 0, self.num_pages - 1)]

  def release(self, pages: jax.Array) -> "PagedKVCache":
    """Pushes page ids [M] back on the free stack.

    Entries outside [0, P) (-1 in particular) are ignored, so a bad id can never
    land on the free stack. The caller removes the pages from the page table
    (``reset`` does both); their slots are marked empty (position -1, score 0)
    so a page handed out again carries nothing of its previous owner.
    """
    check_array("pages", pages, "[M]", (None,), "int")
    valid = (pages >= 0) & (pages < self.num_pages)
    rank = jnp.cumsum(valid) - 1
    target = jnp.where(valid, self.num_free + rank, self.num_pages)
    # A page mask, not a scatter of [M, S_page] fill values: an eviction hands in an
    # id (mostly -1) for every page of every head, and XLA would materialize the
    # fill values of all of them.
    freed = jnp.zeros((self.num_pages,), bool).at[
        jnp.where(valid, pages, self.num_pages)].set(True, mode="drop")[:, None]
    return self.replace(
        free_pages=self.free_pages.at[target].set(pages, mode="drop"),
        num_free=self.num_free + valid.sum(dtype=jnp.int32),
        positions=jnp.where(freed, EMPTY, self.positions),
        scores=jnp.where(freed, 0.0, self.scores),
    )

  def reset(self, sequences: jax.Array) -> "PagedKVCache":
    """Empties the chosen sequences so their batch rows can take new prompts.

    Every page the chosen sequences own, in every layer and KV head, goes back
    on the free stack (``release``: positions -1, scores 0), their page-table
    rows become -1 and their lengths 0. Other sequences are untouched. Keys and
    values are not zeroed: nothing reads a slot past a head's length.

    Args:
      sequences: bool [B], True for the sequences to empty.
    """
    check_array("sequences", sequences, "[B]", (self.batch_size,), "bool")
    chosen = jnp.asarray(sequences)[:, None, None]  # [B, 1, 1]
    pages = jnp.where(chosen[..., None], self.page_table, EMPTY).reshape(-1)
    out = self.release(pages)
    return out.replace(
        page_table=jnp.where(chosen[..., None], EMPTY, self.page_table),
        lengths=jnp.where(chosen, 0, self.lengths))

  # ---------------------------------------------------------------- writes

  def write(
      self,
      layer: jax.Array | int,
      k: jax.Array,
      v: jax.Array,
      slots: jax.Array,
      positions: jax.Array,
      scores: jax.Array | None = None,
  ) -> "PagedKVCache":
    """Writes tokens into slots of one layer; does not change lengths.

    Args:
      layer: layer index (may be traced).
      k, v: [B, T, K, H] keys (already rotated) and values.
      slots: [B, K, T] int32 destination slot of each token per head; -1 (or
        a slot whose page is not allocated) skips the token.
      positions: [B, T] int32 original positions of the tokens.
      scores: optional [B, K, T] float32 per-slot statistics to store (else 0).
    """
    b, kh, h = self.batch_size, self.num_kv_heads, self.k_pages.shape[-1]
    check_layer(layer, self.num_layers)
    check_array("k", k, "[B, T, K, H]", (b, None, kh, h), "float")
    t = jnp.shape(k)[1]
    check_array("v", v, "[B, T, K, H]", (b, t, kh, h), "float")
    check_array("slots", slots, "[B, K, T]", (b, kh, t), "int")
    check_array("positions", positions, "[B, T]", (b, t), "int")
    if scores is not None:
      check_array("scores", scores, "[B, K, T]", (b, kh, t), "float")
    scores = jnp.zeros(slots.shape, jnp.float32) if scores is None else scores
    return self._write(layer, k, v, slots, positions, scores)

  def _write(self, layer, k, v, slots, positions, scores) -> "PagedKVCache":
    """``write`` without its checks; ``scores`` None leaves the slots' scores as they are."""
    ps = self.page_size
    table = self.page_table[:, layer]  # [B, K, P_max]
    p_max = table.shape[-1]
    page_idx = jnp.clip(slots // ps, 0, p_max - 1)
    page = jnp.take_along_axis(table, page_idx, axis=-1)  # [B, K, T]
    ok = (slots >= 0) & (slots < p_max * ps) & (page >= 0)
    page = jnp.where(ok, page, self.num_pages)  # out of bounds: dropped
    offset = slots % ps
    kt = jnp.swapaxes(k, 1, 2).astype(self.k_pages.dtype)  # [B, K, T, H]
    vt = jnp.swapaxes(v, 1, 2).astype(self.v_pages.dtype)
    pos = jnp.broadcast_to(positions[:, None, :], slots.shape)
    out = self.replace(
        k_pages=self.k_pages.at[page, offset].set(kt, mode="drop"),
        v_pages=self.v_pages.at[page, offset].set(vt, mode="drop"),
        positions=self.positions.at[page, offset].set(pos, mode="drop"))
    if scores is None:
      return out
    return out.replace(
        scores=self.scores.at[page, offset].set(scores.astype(jnp.float32), mode="drop"))

  def append(self, layer, k: jax.Array, v: jax.Array, positions: jax.Array) -> "PagedKVCache":
    """Appends one token per sequence to every head of a layer.

    Args:
      k, v: [B, 1, K, H]; positions: [B, 1]. Pages must have been reserved.
      A head already at capacity drops the token (policies evict first); so
      does a head whose next slot has no page (``reserve`` was not called), so
      its length never counts a slot that holds nothing. A ring layer's head
      stores it at slot position % W, over the entry that leaves the window.
    """
    b, kh, h = self.batch_size, self.num_kv_heads, self.k_pages.shape[-1]
    check_layer(layer, self.num_layers)
    check_array("k", k, "[B, 1, K, H]", (b, 1, kh, h), "float")
    check_array("v", v, "[B, 1, K, H]", (b, 1, kh, h), "float")
    check_array("positions", positions, "[B, 1]", (b, 1), "int")
    table, lengths = self.layer_view(layer)  # [B, K, P_max], [B, K]
    cap = self.capacity_array()[layer][None]  # [1, K]
    ring = jnp.asarray(self.windows)[layer] if self.ring_window else None
    slot, fits, new_lengths = _next_slots(lengths, positions, cap, ring)
    page = jnp.take_along_axis(
        table, jnp.minimum(slot // self.page_size, table.shape[-1] - 1)[..., None], -1)[..., 0]
    fits &= page >= 0
    # No score write where the slot is new: a slot at or past a head's length
    # already scores 0 (pages are freed and slots vacated with score 0); a ring's
    # reused slot gets 0.
    out = self._write(layer, k, v, jnp.where(fits, slot, EMPTY)[..., None], positions,
                      jnp.zeros(slot.shape + (1,), jnp.float32) if self.ring_window else None)
    return out.replace(lengths=out.lengths.at[:, layer].set(
        jnp.where(fits, new_lengths, lengths)))

  def open_token_slots(self, positions: jax.Array, active: jax.Array | None = None
                       ) -> tuple["PagedKVCache", jax.Array]:
    """Makes room for one new token per sequence in every (layer, KV head) at once.

    A decode step's bookkeeping in one pass, before the forward: a page where a
    head's next slot starts one (at most one per head: a cumulative sum over
    [B, L, K] and one scatter into the page table, not ``reserve``'s sweep of
    every table entry), the token's position in every layer's slot, and the
    lengths. Each layer then only stores its key and value (``write_token``);
    the slot's score is already 0 (see ``append``).
    The cache ends as ``reserve(lengths + 1)`` followed by every layer's
    ``append`` leaves it, keys and values aside. A head at capacity drops the
    token (policies evict first); a ring layer's head takes it at its
    position's slot, over the entry that leaves the window.

    Args:
      positions: [B] int32 the token's original position.
      active: bool [B], the sequences that take a token (None: all); the
        others are left as they are (a serving engine's empty slots).

    Returns:
      (cache, slots [B, L, K] int32: the token's slot in the pool, page id *
      S_page + offset, or -1 where the head drops it).
    """
    b, l, kh, p_max = self.page_table.shape
    check_array("positions", positions, "[B]", (b,), "int")
    ps = self.page_size
    lengths = self.lengths
    ring = jnp.asarray(self.windows)[None, :, None] if self.ring_window else None  # [1, L, 1]
    slot, fits, new_lengths = _next_slots(lengths, positions[:, None, None],
                                          self.capacity_array()[None], ring)  # [B, L, K]
    if active is not None:
      fits = fits & active[:, None, None]
    index = jnp.minimum(slot // ps, p_max - 1)[..., None]
    offset = slot % ps
    page = jnp.take_along_axis(self.page_table, index, -1)[..., 0]  # [B, L, K]
    grow = fits & (page < 0)  # pages fill a head's row front to back
    page = jnp.where(grow, self._pop_free(grow), page)
    heads = jnp.arange(b * l * kh)
    table = self.page_table.reshape(b * l * kh, p_max).at[
        jnp.where(grow.reshape(-1), heads, b * l * kh), index.reshape(-1)].set(
            page.reshape(-1), mode="drop").reshape(self.page_table.shape)
    at = jnp.where(fits, page, self.num_pages)  # out of bounds: dropped
    pos = jnp.broadcast_to(positions[:, None, None], at.shape)
    out = self.replace(
        page_table=table,
        num_free=self.num_free - grow.sum(dtype=jnp.int32),
        positions=self.positions.at[at, offset].set(pos, mode="drop"),
        lengths=jnp.where(fits, new_lengths, lengths))
    if self.ring_window:  # a ring's reused slot drops its old score
      out = out.replace(scores=out.scores.at[at, offset].set(0.0, mode="drop"))
    return out, jnp.where(fits, page * ps + offset, EMPTY)

  def write_token(self, layer, k: jax.Array, v: jax.Array, slots: jax.Array) -> "PagedKVCache":
    """Stores one token's key and value per head of a layer at ``open_token_slots``' slots.

    Args:
      layer: layer index (may be traced).
      k, v: [B, 1, K, H]; slots: [B, K] int32 pool slots (-1 = drop).
    """
    b, kh, h = self.batch_size, self.num_kv_heads, self.k_pages.shape[-1]
    check_layer(layer, self.num_layers)
    check_array("k", k, "[B, 1, K, H]", (b, 1, kh, h), "float")
    check_array("v", v, "[B, 1, K, H]", (b, 1, kh, h), "float")
    check_array("slots", slots, "[B, K]", (b, kh), "int")
    ps = self.page_size
    page = jnp.where(slots >= 0, slots // ps, self.num_pages)
    offset = slots % ps
    return self.replace(
        k_pages=self.k_pages.at[page, offset].set(k[:, 0].astype(self.k_pages.dtype), mode="drop"),
        v_pages=self.v_pages.at[page, offset].set(v[:, 0].astype(self.v_pages.dtype), mode="drop"))

  # ---------------------------------------------------------------- eviction
  # Every eviction is one call of the execution's ``compact_slots`` op (the Pallas
  # kernel, or its jnp reference): kept entries move to their head's first
  # slots, the head's pages past them go back on the free stack. The bodies
  # live in ``kvjax.cache.eviction``.

  def remove(self, slots: jax.Array, *, ex: execution.Execution | None = None
             ) -> "PagedKVCache":
    """Evicts one slot per head, [B, L, K] (-1 = none), keeping slots dense.

    The head's last filled slot moves into the evicted one (order inside a head
    carries no meaning: each slot records its original position), so the head
    holds one entry fewer and its next append lands at the end; a page left
    empty goes back on the free stack. Slots outside [0, length) are ignored.
    ``ex``: the execution whose ``compact_slots`` moves the entries (every
    eviction takes one; None: ``kvjax.execution.ambient()``, for a user's own code).
    """
    return eviction.remove(self, slots, ex=ex)

  def drop_pages(self, index: jax.Array, *, ex: execution.Execution | None = None
                 ) -> "PagedKVCache":
    """Evicts one whole page per head, [B, L, K] page index within the head (-1 = none).

    The page leaves the head's page-table row, the later pages move one place
    forward (slot order is kept: slot s of the head's later pages becomes slot
    s - page_size), and the page goes back on the free stack (``release``:
    positions -1, scores 0). No key or value moves: this is a page-table edit.
    The head loses the entries the page held: page_size for any page but the
    last, whatever the last holds for it. Indices outside the pages a head
    owns are ignored.
    """
    return eviction.drop_pages(self, index, ex=ex)

  def compact(self, layer, keep: jax.Array, *, ex: execution.Execution | None = None
              ) -> "PagedKVCache":
    """Keeps the given slots of each head of one layer and frees the pages left over.

    Args:
      layer: layer index (may be traced).
      keep: [B, K, S_keep] int32 slots each head keeps (-1 = none; any order,
        duplicates and slots past the head's length ignored).

    The kept entries move to slots 0 .. n - 1 in their original slot order, in
    place, and the pages past them go back on the free stack.
    """
    return eviction.compact(self, layer, keep, ex=ex)

  def store_kept(self, layer, keep: jax.Array, entries: tuple[jax.Array, ...], *,
                 ex: execution.Execution | None = None) -> "PagedKVCache":
    """Replaces each head of one layer by the entries ``keep`` marks, in order.

    The store from scratch of a compression: the entries (a head's cached
    entries as read, and new ones that never entered the pool) come as dense
    rows, the kept ones fill the head's first slots and the head's pages past
    them are freed. Taking the cached keys and values from what was read, not
    from the pools, orders the pools' update after every read of them, so XLA
    updates them in place.

    Args:
      layer: layer index (may be traced).
      keep: [B, K, U] bool, the entries each head keeps (at most its capacity;
        the excess is lost).
      entries: (keys [B, K, U, H], values [B, K, U, H], positions [B, K, U],
        scores [B, K, U]).
    """
    return eviction.store_kept(self, layer, keep, entries, ex=ex)

  def set_lengths(self, layer, lengths: jax.Array) -> "PagedKVCache":
    """Sets the filled slots [B, K] of one layer, clamped to [0, capacity].

    The clamp keeps a length from ever counting slots past a head's pages:
    attention would read them from whatever page id 0 holds (another head's).
    """
    check_layer(layer, self.num_layers)
    check_array("lengths", lengths, "[B, K]", (self.batch_size, self.num_kv_heads), "int")
    cap = self.capacity_array()[layer][None]  # [1, K]
    clamped = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, cap)
    return self.replace(lengths=self.lengths.at[:, layer].set(clamped))

  # ---------------------------------------------------------------- reads

  def layer_view(self, layer) -> tuple[jax.Array, jax.Array]:
    """(page_table [B, K, P_max], lengths [B, K]) of one layer."""
    return self.page_table[:, layer], self.lengths[:, layer]

  def kept_positions(self) -> jax.Array:
    """Original position of every kept slot: int32 [B, L, K, S], -1 when empty."""
    b, l, k, p_max = self.page_table.shape
    pos = self.positions[jnp.maximum(self._pool_page_table(), 0)].reshape(b, l, k, -1)
    slot = jnp.arange(p_max * self.page_size)
    return jnp.where(slot < self.lengths[..., None], pos, EMPTY)

  def _pool_page_table(self) -> jax.Array:
    """[B, L, K, P_max] page ids into the whole pool (``shards``: a block's ids made global)."""
    d, m = self.shards
    if (d, m) == (1, 1):
      return self.page_table
    b, _, k, _ = self.page_table.shape
    block = ((jnp.arange(b) // (b // d))[:, None] * m + jnp.arange(k) // (k // m))[:, None, :]
    offset = block[..., None] * (self.num_pages // (d * m))  # [B, 1, K, 1]
    return jnp.where(self.page_table >= 0, self.page_table + offset, EMPTY)


def _next_slots(lengths, positions, capacity, ring):
  """Where one new token goes in each head: (slot, fits, lengths after it), each
  broadcast from lengths, positions, capacity and ring (W, or 0 for a head that fills
  slot after slot; None when no layer is a ring). A ring's token goes to slot
  position % W: its next slot until the ring is full, then the slot of the
  position that leaves the window."""
  if ring is None:
    return lengths, lengths < capacity, lengths + 1
  slot = jnp.where(ring > 0, positions % jnp.maximum(ring, 1), lengths)
  return slot, slot < capacity, jnp.maximum(lengths, slot + 1)
