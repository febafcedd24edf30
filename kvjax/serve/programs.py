"""The engine's programs: generate's program bodies over one shared page pool.

The engine's cache holds S slots (its batch rows) over one pool of pages.
A prompt is prefilled into one slot through a one-row view of the cache
(``_slot_view``: that slot's page table and lengths, the whole pool and free
stack), so the policy sees the request alone, exactly as ``generate`` would
on a batch of one; the view's pages and lengths are then written back. The
decode program runs a fixed number of steps over all S slots at once, empty
or finished slots masked (they take no page and no token).

Every program takes the model's parameters, then the cache (argument 1,
donated); its keyword arguments are static, so the engine compiles each once
per shape: one decode program, a prefill per padded chunk size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.generation import programs as gen_programs


def _jit(*statics):
  """jit with the cache (argument 1) donated and ``statics`` static."""
  return functools.partial(jax.jit, static_argnames=statics, donate_argnums=(1,))


def _slot_view(cache, slot):
  """The one-row cache of ``slot`` (a traced int): its page table and lengths, the shared pool."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
  return cache.replace(page_table=take(cache.page_table), lengths=take(cache.lengths))


def _merge(cache, view, slot):
  """``cache`` with ``view``'s pool, free stack and its slot's row written back."""
  put = lambda x, row: jax.lax.dynamic_update_slice_in_dim(x, row, slot, axis=0)
  return view.replace(page_table=put(cache.page_table, view.page_table),
                      lengths=put(cache.lengths, view.lengths))


@_jit("graphdef", "policy", "layout", "ex")
def prefill_chunk(params, cache, slot, tokens, length, offset, logits, *, graphdef, policy,
                  layout, ex):
  """One prompt chunk of one slot: tokens [1, C], length [1] valid tokens, offset [1]
  its first position, logits [1, V] so far. Returns (cache, logits [1, V])."""
  view, logits = gen_programs.prefill_chunk(params, _slot_view(cache, slot), tokens, length,
                                            offset, logits, graphdef=graphdef, policy=policy,
                                            layout=layout, ex=ex)
  return _merge(cache, view, slot), logits


@_jit("graphdef", "policy", "layout", "block", "ex")
def prefill(params, cache, slot, tokens, length, *, graphdef, policy, layout, block, ex):
  """A whole prompt into one slot at once: tokens [1, T] (right-padded), length [1].
  For policies that cannot compress in chunks. Returns (cache, logits [1, V])."""
  view, logits = gen_programs.prefill(params, _slot_view(cache, slot), tokens, length,
                                      graphdef=graphdef, policy=policy, layout=layout,
                                      block=block, ex=ex)
  return _merge(cache, view, slot), logits


@functools.partial(jax.jit, donate_argnums=(0,))
def reset(cache, slots):
  """Empties the slots (bool [S]): their pages go back on the free stack."""
  return cache.reset(slots)


@jax.jit
def held_pages(cache):
  """[S] int32 the pages each slot holds, over every layer and KV head."""
  return (cache.page_table >= 0).sum((1, 2, 3), dtype=jnp.int32)


def sample(logits, temperature, top_k, seeds, positions):
  """Each row's next token [S] int32: the most likely at temperature 0, else drawn from
  softmax(logits / temperature) over the row's ``top_k`` most likely tokens (0: all),
  with a key of the row's seed and position, so a request's draws do not depend on
  the other slots or on when it was scheduled."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw():
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    scaled = jax.lax.cond(jnp.any(top_k > 0), _top_k_only, lambda s, _: s, scaled, top_k)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        seeds, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  # A greedy batch draws nothing: the branch not taken costs nothing.
  return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)


def _top_k_only(scaled, top_k):
  """scaled [S, V] with -inf below each row's ``top_k``-th largest (rows with 0 kept)."""
  ranked = -jnp.sort(-scaled, axis=-1)
  kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, scaled.shape[1] - 1)[:, None], 1)
  return jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)


first_token = jax.jit(sample)


@_jit("graphdef", "policy", "steps", "ex")
def decode(params, cache, slots, *, graphdef, policy, steps, ex):
  """``steps`` decode steps over every slot; returns (cache, slots, tokens [S, steps],
  free pages).

  ``slots``: ``SlotArrays.arrays`` (serve/slots.py). A slot ends on a stop id or
  when nothing remains; tokens are -1 where a slot was not active. Also returns
  the pool's free pages, read with the tokens in the dispatch's one host sync.
  """
  question = jnp.zeros(slots["positions"].shape + (2,), jnp.int32)
  no_limit = jnp.iinfo(jnp.int32).max

  def step(i, carry):
    cache, s, tokens = carry
    active, positions = s["active"], s["positions"]
    limit = jnp.where(active[:, None, None], s["limit"], no_limit)
    cache, logits = gen_programs.decode_step(params, cache, s["last"], positions, limit,
                                             question, graphdef=graphdef, policy=policy,
                                             ex=ex, active=active)
    token = sample(logits, s["temperature"], s["top_k"], s["seeds"], positions + 1)
    remaining = s["remaining"] - active
    done = jnp.any(token[:, None] == s["stops"], axis=1) | (remaining <= 0)
    s = dict(s, last=jnp.where(active, token, s["last"]), positions=positions + active,
             remaining=remaining, active=active & ~done)
    return cache, s, tokens.at[:, i].set(jnp.where(active, token, -1))

  tokens = jnp.full((slots["last"].shape[0], steps), -1, jnp.int32)
  cache, slots, tokens = jax.lax.fori_loop(0, steps, step, (cache, slots, tokens))
  return cache, slots, tokens, cache.num_free
