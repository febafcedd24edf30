"""The state the decode loop carries from one step to the next."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache.paged import PagedKVCache
from kvjax.sharding.collectives import MeshAxes


@struct.dataclass
class DecodeState:
  """One decode loop's carry (B sequences, M = max_new_tokens).

  Token 0 comes from the prompt's logits; step ``s`` feeds token ``s - 1``
  through the model and writes token ``s``. A sequence that has produced a
  stop id is done: its later tokens are ``pad_id``.
  """

  step: jax.Array  # [] int32: the next token to write, 1 .. M
  tokens: jax.Array  # [B, M] int32: the tokens so far, pad_id after them
  done: jax.Array  # [B] bool: the sequence has produced a stop id
  cache: PagedKVCache
  rng: jax.Array  # a key, split for every draw

  @classmethod
  def start(cls, first: jax.Array, cache: PagedKVCache, rng: jax.Array, *, max_new_tokens: int,
            pad_id: jax.Array, stops: jax.Array) -> "DecodeState":
    """The state after token 0 (``first`` [B] int32) was chosen; stops [S] int32."""
    tokens = jnp.full((first.shape[0], max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    return cls(step=jnp.int32(1), tokens=tokens, done=jnp.isin(first, stops), cache=cache,
               rng=rng)

  def running(self, axes: MeshAxes = MeshAxes()) -> jax.Array:
    """Whether another step is due: tokens are left to write and a sequence is not done
    (on a mesh, anywhere on its ``axes``)."""
    return (self.step < self.tokens.shape[1]) & ~axes.all_anywhere(self.done)

  def last(self) -> jax.Array:
    """[B] int32: the token the next step feeds through the model."""
    return self.tokens[:, self.step - 1]

  def advance(self, token: jax.Array, cache: PagedKVCache, rng: jax.Array, *, pad_id: jax.Array,
              stops: jax.Array) -> "DecodeState":
    """Writes ``token`` [B] (``pad_id`` where done) and moves to the next step."""
    token = jnp.where(self.done, pad_id, token)
    return self.replace(step=self.step + 1, tokens=self.tokens.at[:, self.step].set(token),
                        done=self.done | jnp.isin(token, stops), cache=cache, rng=rng)
