"""The bodies of generate's programs, traced and compiled by ``kvjax.generation.compile``.

  prefill        the prompt's forward pass, filling (and compressing) the cache
  record         the prompt's forward pass, recording every layer's q, k, v
  score          a policy's scores of a recorded prompt, shared by its runs' stores
  store          what a policy keeps of a recorded prompt, into the cache
  prefill_chunk  one prompt chunk: attend to the cache and itself, compress back
  extend         a chunk (the question) appended to the cache uncompressed
  decode         the whole decode loop, in one ``while_loop`` of ``decode_step``s

Each takes the model's parameters and then the cache (argument 1, donated) or
what stands in its place; its keyword arguments are static. Among them
``ex``, the ``kvjax.execution.Execution`` the program is built for: the
attention entry points, the policy and the packed weights' products take
their kernels from it, op by op, and their mesh axes; nothing ambient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.cache import attention as attention_lib
from kvjax.generation.state import DecodeState
from kvjax.policies.layout import NO_LIMIT

# What each program's arguments and results are, for running it per device on
# a mesh (``kvjax.sharding.programs``): "params", "cache", or a kind of
# ``kvjax.sharding.layout.SPECS``; "to_host" results are gathered whole.
MESH_KINDS = {
    "prefill": (("params", "cache", "batch", "batch"), ("cache", "batch")),
    "record": (("params", "recorded", "batch", "batch"), ("recorded", "batch")),
    "store": (("params", "cache", "recorded", "batch", "batch"), "cache"),
    "prefill_chunk": (("params", "cache", "batch", "batch", "batch", "batch"),
                      ("cache", "batch")),
    "extend": (("params", "cache", "batch", "batch", "batch"), ("cache", "batch")),
    "decode": (("params", "cache", "batch", "batch", "heads", "batch", "replicated",
                "replicated", "replicated", "replicated"), ("to_host", "replicated", "cache")),
}


def _positions(tokens: jax.Array, offsets: jax.Array | None = None) -> jax.Array:
  """[B, T] int32 position of each token: from 0, or from each row's offset [B]."""
  steps = jnp.arange(tokens.shape[1], dtype=jnp.int32)
  if offsets is None:
    return jnp.broadcast_to(steps, tokens.shape)
  return offsets[:, None] + steps[None]


def _forward(graphdef, params, tokens, positions, state, attend, last, ex):
  """Runs the model over tokens [B, T], attending with ``attend`` (which carries ``state``).

  Returns:
    (state, logits [B, V] at each row's token ``last`` [B]).
  """
  model = nnx.merge(graphdef, params)
  hidden, state = model(tokens, positions, state, attend, ex)
  return state, model.logits(hidden[jnp.arange(tokens.shape[0]), last], ex)


def prefill(params, cache, tokens, lengths, *, graphdef, policy, layout, block, ex):
  """Prompt forward pass that fills (and compresses) the cache; returns (cache, logits [B, V]).

  Args:
    tokens: [B, T] int32, right-padded; lengths: [B] int32.
  """
  positions = _positions(tokens)
  select = policy.select(ex, layout)

  def attend(cache, layer, q, k, v):
    return attention_lib.prefill_attention(
        cache, layer, q, k, v, positions, lengths, tokens=tokens, select=select, block=block,
        ex=ex)

  return _forward(graphdef, params, tokens, positions, cache, attend, lengths - 1, ex)


def record(params, buffers, tokens, lengths, *, graphdef, block, ex):
  """Prompt forward pass that records every layer's q, k, v (no cache, no policy).

  Args:
    buffers: (q [L, B, T, N, H], k [L, B, T, K, H], v [L, B, T, K, H]) to fill
      (donated: filled in place).

  Returns:
    (the filled buffers, logits [B, V] at each sequence's last token).
  """
  windows = nnx.merge(graphdef, params).config.layer_windows

  def attend(buffers, layer, q, k, v):
    window, local = attention_lib.layer_window(windows, layer)
    out = attention_lib.prompt_attention(q, k, v, window=window, local=local, block=block,
                                         ex=ex)
    return tuple(b.at[layer].set(x.astype(b.dtype)) for b, x in zip(buffers, (q, k, v))), out

  return _forward(graphdef, params, tokens, _positions(tokens), buffers, attend, lengths - 1,
                  ex)


def score(params, scores, recorded, tokens, lengths, *, graphdef, policy, ex):
  """A policy's prefill scores of a recorded prompt (``record``) on every global layer.

  The runs of one recorded prompt at several budgets store from them
  (``Policy.shares_scores``: H2O's accumulated attention is a second attention
  pass over the prompt, the same at every budget).

  Args:
    scores: [L, B, K, T] float32 zeros to fill (donated); sliding-window
      layers keep their window and stay zero.

  Returns:
    the filled scores.
  """
  global_layers = jnp.asarray(nnx.merge(graphdef, params).config.global_layers)
  prompt = attention_lib.Prompt(tokens, _positions(tokens), lengths)

  def layer_scores(layer):
    q, k, v = (x[layer] for x in recorded)
    return policy.score(ex, prompt, q, k, v).astype(scores.dtype)

  return scores.at[global_layers].set(jax.lax.map(layer_scores, global_layers))


def store(params, cache, recorded, tokens, lengths, scores=None, *, graphdef, policy, layout,
          ex):
  """Stores what the policy keeps of a recorded prompt (``record``) in every layer.

  Takes (and ignores) params so that, like every program here, the cache is
  argument 1, the one that is donated. Returns the cache.

  Args:
    scores: None, or the policy's scores [L, B, K, T] (``score``) to keep by
      instead of scoring each layer here.
  """
  del params, graphdef
  prompt = attention_lib.Prompt(tokens, _positions(tokens), lengths)
  select = (policy.select_recorded(ex, layout, prompt, recorded) if scores is None
            else policy.select(ex, layout, scores))

  def layer_body(layer, cache):
    q, k, v = (x[layer] for x in recorded)
    return attention_lib.store_prompt(cache, layer, prompt, q, k, v, select)

  return jax.lax.fori_loop(0, recorded[0].shape[0], layer_body, cache)


def prefill_chunk(params, cache, tokens, lengths, offsets, logits, *, graphdef, policy, layout,
                  ex):
  """One prompt chunk: attend to the cache and itself, then compress back to the budget.

  Args:
    tokens: [B, C] int32, the chunk; lengths: [B] int32 its valid tokens per
      sequence (0 past a sequence's end); offsets: [B] int32 its first position.
    logits: [B, V] each sequence's next-token logits so far (zeros before the first chunk).

  Returns (cache, logits [B, V]: at each sequence's last token in the chunk, or
  the given ones where the chunk has none of its tokens).
  """
  positions = _positions(tokens, offsets)
  # Each (sequence, KV head) is compressed as a one-head sequence of its own:
  # nothing to reduce across devices.
  select = policy.select(ex.local(), layout)

  def attend(cache, layer, q, k, v):
    return attention_lib.chunk_attention(cache, layer, q, k, v, positions, lengths,
                                         select=select, ex=ex)

  cache, last = _forward(graphdef, params, tokens, positions, cache, attend,
                         jnp.maximum(lengths - 1, 0), ex)
  return cache, jnp.where((lengths > 0)[:, None], last, logits)


def extend(params, cache, tokens, lengths, offsets, *, graphdef, ex):
  """Appends a chunk (the question) to the cache uncompressed; returns (cache, logits [B, V])."""
  positions = _positions(tokens, offsets)

  def attend(cache, layer, q, k, v):
    return attention_lib.extend_attention(cache, layer, q, k, v, positions, lengths)

  return _forward(graphdef, params, tokens, positions, cache, attend, lengths - 1, ex)


def decode_step(params, cache, tokens, positions, limit, question, *, graphdef, policy, ex,
                active=None):
  """One decode step: the policy's decode rule, then ``tokens`` [B] at ``positions`` [B]
  through the model, each appended to its sequence's cache.

  ``limit`` [B, L, K] and ``question`` [B, 2] as for ``decode``; ``active`` bool [B]:
  the sequences that take their token (None: all; ``PagedKVCache.open_token_slots``).
  Returns (cache, next-token logits [B, V]).
  """
  cache = policy.before_decode_step(ex, cache, limit, positions, question)
  # Every layer's page, position and length at once; each layer stores k and v.
  cache, slots = cache.open_token_slots(positions, active=active)

  def attend(cache, layer, q, k, v):
    return attention_lib.decode_attention(cache, layer, q, k, v, positions[:, None],
                                          accumulate=policy.accumulates_attention,
                                          slots=slots[:, layer], active=active, ex=ex)

  return _forward(graphdef, params, tokens[:, None], positions[:, None], cache, attend,
                  jnp.zeros_like(positions), ex)


def decode(params, cache, first_logits, next_positions, limit, question, seed, stops, sampler,
           pad_id, *, graphdef, policy, max_new_tokens, block, ex):
  """Greedy or sampled decoding in one while_loop, ``block`` steps per iteration.

  Args:
    first_logits: [B, V] the next-token logits after the prompt.
    next_positions: [B] int32 position of the first generated token.
    limit: [B, L, K] int32 entries a head may hold (decode-evicting policies).
    question: [B, 2] int32 positions [start, end) of each question, which page
      eviction never takes ([0, 0) for none).
    seed: [] uint32; stops: [S] int32 stop ids; pad_id: [] int32.
    sampler: a ``kvjax.generation.sampling`` sampler.
    block: decode steps per iteration of the while_loop (``decode_block``). On a GPU
      XLA reads a while_loop's predicate on the host every iteration, and cannot
      queue the next one meanwhile; the steps of a block run in a loop of fixed
      trip count, which it does not. Steps past the end are masked (they write
      no token, take no page and change no score): the same tokens and cache.

  Returns:
    (tokens [B, max_new_tokens] int32, steps run (1 + forward passes), cache).
  """
  # On a mesh each data shard samples its sequences with keys of its own.
  rng, key = jax.random.split(ex.axes.data_shard_key(jax.random.key(seed)))
  state = DecodeState.start(sampler(first_logits, key), cache, rng,
                            max_new_tokens=max_new_tokens, pad_id=pad_id, stops=stops)
  running = functools.partial(DecodeState.running, axes=ex.axes)

  def step(state: DecodeState, run=None) -> DecodeState:
    active = None if run is None else jnp.broadcast_to(run, next_positions.shape)
    cache, logits = decode_step(params, state.cache, state.last(),
                                next_positions + state.step - 1,
                                limit if run is None else jnp.where(run, limit, NO_LIMIT),
                                question, graphdef=graphdef, policy=policy, ex=ex, active=active)
    rng, key = jax.random.split(state.rng)
    return state.advance(sampler(logits, key), cache, rng, pad_id=pad_id, stops=stops)

  def masked_step(_, state: DecodeState) -> DecodeState:
    run = running(state)
    new = step(state, run)
    keep = lambda a, b: jnp.where(run, a, b)
    return new.replace(step=keep(new.step, state.step), tokens=keep(new.tokens, state.tokens),
                       done=keep(new.done, state.done))

  if block == 1:
    state = jax.lax.while_loop(running, step, state)
  else:
    state = jax.lax.while_loop(
        running, lambda s: jax.lax.fori_loop(0, block, masked_step, s), state)
  return state.tokens, state.step, state.cache


def decode_block(platform: str, max_new_tokens: int, most: int | None = None) -> int:
  """Decode steps per host round trip: ``most`` (None: 8 on a GPU, 1 elsewhere: a
  TPU runs its loops on the device, a CPU has no host to go back to), evened out so
  that the last block wastes as few steps as can be."""
  most = (8 if platform == "gpu" else 1) if most is None else most
  steps = max_new_tokens - 1  # forward passes: the first token comes from the prompt
  if steps <= 1 or most == 1:
    return 1
  blocks = -(-steps // most)
  return -(-steps // blocks)
