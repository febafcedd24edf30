"""How the decode loop picks the next token from its logits.

A sampler is a small pytree called as ``sampler(logits [B, V], key) -> [B]
int32``. It is an argument of the decode program, not a static one: its
temperature is a traced array, so one compiled program serves every
temperature (0 included); what changes the program (the sampler's class,
``TopK.k``) sits in its tree structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.host_memory import to_device


@struct.dataclass
class Greedy:
  """The most likely token."""

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    del key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class Temperature:
  """A token drawn from softmax(logits / temperature); the most likely one at temperature 0."""

  temperature: jax.Array  # [] float32 >= 0

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    return _draw_unless_cold(self.temperature, logits, key, top_k=0)


@struct.dataclass
class TopK:
  """As ``Temperature``, among the ``k`` most likely tokens only."""

  temperature: jax.Array  # [] float32 >= 0
  k: int = struct.field(pytree_node=False)  # static: sets the program

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    return _draw_unless_cold(self.temperature, logits, key, top_k=self.k)


Sampler = Greedy | Temperature | TopK


def from_options(temperature: float, top_k: int) -> Temperature | TopK:
  """The sampler of generate's ``temperature`` and ``top_k`` (0 = every token).

  Temperature 0 is greedy inside the same program, so switching between
  greedy and sampled decoding compiles nothing new.
  """
  temperature = to_device(temperature, np.float32)
  return TopK(temperature, k=top_k) if top_k else Temperature(temperature)


def _draw_unless_cold(temperature: jax.Array, logits: jax.Array, key: jax.Array, *,
                      top_k: int) -> jax.Array:
  """logits [B, V] -> token ids [B]: drawn at temperature > 0, else the most likely."""

  def draw():
    scaled = logits / jnp.maximum(temperature, 1e-6)
    if top_k:
      kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
      scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled).astype(jnp.int32)

  # The branch not taken costs nothing, where a select would draw V Gumbel
  # variates every step of a greedy decode.
  return jax.lax.cond(temperature > 0, draw, lambda: Greedy()(logits, key))
