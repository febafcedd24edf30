"""The engine's programs: generate's program bodies over one shared page pool.

The engine's cache holds S slots (its batch rows) over one pool of pages.
A prompt is prefilled into one slot through a one-row view of the cache
(``_slot_view``: that slot's page table and lengths, the whole pool and free
stack), so the policy sees the request alone, exactly as ``generate`` would
on a batch of one; the view's pages and lengths are then written back. The
decode program runs a fixed number of steps over all S slots at once, empty
or idle slots masked (they take no page and no token).

The programs are plain functions that ``kvjax.generation.compile.compiled``
compiles once per shape, with the cache (argument 1) donated; on a mesh they
run per device (``MESH_KINDS``): slots split over the data axis, each data
shard's slots in its own block of the pool, KV heads over the model axis. A
prefill then runs on the data shard that holds its slot; the others pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.generation import programs as gen_programs
from kvjax.sharding.programs import TO_HOST

# Argument and result kinds on a mesh (``kvjax.sharding.programs.compile``).
MESH_KINDS = {
    "prefill_chunk": (("params", "cache") + ("replicated",) * 5, ("cache", "replicated")),
    "prefill": (("params", "cache") + ("replicated",) * 4, ("cache", "replicated")),
    "decode": (("params", "cache", "batch", "heads"), ("cache", "batch", TO_HOST)),
    "reset": (("batch", "cache"), "cache"),
}


def _owned(cache, slot, ex):
  """(whether this device's block holds ``slot``, its row there): on a mesh each data
  shard holds S / D consecutive slots; off a mesh every slot is here."""
  if ex.axes.data is None:
    return None, slot
  rows = cache.page_table.shape[0]
  return slot // rows == jax.lax.axis_index(ex.axes.data), slot % rows


def _on_owner(mine, fn, cache, logits, ex):
  """``fn(cache) -> (cache, logits)`` on the device block that holds the slot; the
  others keep their cache, and every device gets the owner's logits [1, V]."""
  if mine is None:
    return fn(cache)
  cache, logits = jax.lax.cond(mine, fn, lambda c: (c, jnp.zeros_like(logits)), cache)
  return cache, jax.lax.psum(logits, ex.axes.data)


def _slot_view(cache, slot):
  """The one-row cache of ``slot`` (a traced int): its page table and lengths, the shared pool."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
  return cache.replace(page_table=take(cache.page_table), lengths=take(cache.lengths))


def _merge(cache, view, slot):
  """``cache`` with ``view``'s pool, free stack and its slot's row written back."""
  put = lambda x, row: jax.lax.dynamic_update_slice_in_dim(x, row, slot, axis=0)
  return view.replace(page_table=put(cache.page_table, view.page_table),
                      lengths=put(cache.lengths, view.lengths))


def prefill_chunk(params, cache, slot, tokens, length, offset, logits, *, graphdef, policy,
                  layout, ex):
  """One prompt chunk of one slot: slot [] int32, tokens [1, C], length [1] valid tokens,
  offset [1] its first position, logits [1, V] so far. Returns (cache, logits [1, V])."""
  mine, row = _owned(cache, slot, ex)

  def run(cache):
    view, out = gen_programs.prefill_chunk(params, _slot_view(cache, row), tokens, length,
                                           offset, logits, graphdef=graphdef, policy=policy,
                                           layout=layout, ex=ex)
    return _merge(cache, view, row), out

  return _on_owner(mine, run, cache, logits, ex)


def prefill(params, cache, slot, tokens, length, zeros, *, graphdef, policy, layout, block,
            ex):
  """A whole prompt into one slot at once: tokens [1, T] (right-padded), length [1],
  zeros [1, V] (the logits' shape). For policies that cannot compress in chunks.
  Returns (cache, logits [1, V])."""
  mine, row = _owned(cache, slot, ex)

  def run(cache):
    view, out = gen_programs.prefill(params, _slot_view(cache, row), tokens, length,
                                     graphdef=graphdef, policy=policy, layout=layout,
                                     block=block, ex=ex)
    return _merge(cache, view, row), out

  return _on_owner(mine, run, cache, zeros, ex)


def reset(slots, cache, *, ex):
  """Empties the slots (bool [S]): their pages go back on the free stack."""
  del ex  # every program takes the execution; emptying slots needs none of it
  return cache.reset(slots)


@jax.jit
def held_pages(cache):
  """[S] int32 the pages each slot holds, over every layer and KV head."""
  return (cache.page_table >= 0).sum((1, 2, 3), dtype=jnp.int32)


def sample(logits, temperature, top_k, seeds, positions, *, branches: bool = True):
  """Each row's next token [S] int32: the most likely at temperature 0, else drawn from
  softmax(logits / temperature) over the row's ``top_k`` most likely tokens (0: all),
  with a key of the row's seed and position, so a request's draws do not depend on
  the other slots or on when it was scheduled.

  ``branches``: skip the draw (and top-k's sort) when no row needs them. A GPU reads
  a ``lax.cond``'s predicate on the host, a round trip per step: there both run.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  cond = jax.lax.cond if branches else lambda p, yes, no, *args: yes(*args)

  def draw():
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    scaled = cond(jnp.any(top_k > 0), _top_k_only, lambda s, _: s, scaled, top_k)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        seeds, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  # A greedy batch draws nothing: the branch not taken costs nothing.
  return cond(jnp.any(temperature > 0), draw, lambda: greedy)


def _top_k_only(scaled, top_k):
  """scaled [S, V] with -inf below each row's ``top_k``-th largest (rows with 0 kept)."""
  ranked = -jnp.sort(-scaled, axis=-1)
  kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, scaled.shape[1] - 1)[:, None], 1)
  return jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)


first_token = jax.jit(sample)


def decode(params, cache, slots, limit, *, graphdef, policy, steps, ex):
  """``steps`` decode steps over every slot; returns (cache, slots, tokens [S, steps]).

  ``slots``: ``SlotArrays.arrays`` (serve/slots.py); limit [S, L, K] entries a head
  may hold. A slot ends on a stop id or when nothing remains; tokens are -1 where a
  slot was not active.
  """
  question = jnp.zeros(slots["positions"].shape + (2,), jnp.int32)
  no_limit = jnp.iinfo(jnp.int32).max

  def step(i, carry):
    cache, s, tokens = carry
    active, positions = s["active"], s["positions"]
    head_limit = jnp.where(active[:, None, None], limit, no_limit)
    cache, logits = gen_programs.decode_step(params, cache, s["last"], positions, head_limit,
                                             question, graphdef=graphdef, policy=policy,
                                             ex=ex, active=active)
    token = sample(logits, s["temperature"], s["top_k"], s["seeds"], positions + 1,
                   branches=ex.platform != "gpu")
    remaining = s["remaining"] - active
    done = jnp.any(token[:, None] == s["stops"], axis=1) | (remaining <= 0)
    s = dict(s, last=jnp.where(active, token, s["last"]), positions=positions + active,
             remaining=remaining, active=active & ~done)
    return cache, s, tokens.at[:, i].set(jnp.where(active, token, -1))

  tokens = jnp.full((slots["last"].shape[0], steps), -1, jnp.int32)
  return jax.lax.fori_loop(0, steps, step, (cache, slots, tokens))
