"""Reductions that span a device mesh when generate's programs run on one.

A program on a mesh runs per shard (``jax.shard_map``): each device sees the
sequences of its data shard and the KV heads of its model shard. The few
steps that reduce over every sequence of a batch or over every KV head of a
layer call these methods of the program's ``MeshAxes`` (``Execution.axes``),
which reduce the local shard and then across the mesh axis whose shards hold
the rest. ``MeshAxes()`` (no mesh) is each local reduction alone, so
single-device programs trace exactly as they always did.

This module is a leaf: the models, policies and decode state use it through
the execution they are handed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """The mesh axis names of a program's sequences (``data``) and KV heads (``model``)."""

  data: str | None = None
  model: str | None = None

  def _all(self) -> tuple[str, ...]:
    return tuple(a for a in (self.data, self.model) if a)

  def model_sum(self, x: jax.Array) -> jax.Array:
    """The sum over model shards of a partial product (tensor parallelism's all-reduce)."""
    return jax.lax.psum(x, self.model) if self.model else x

  def heads_sum(self, x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
    """``x.sum(axis)`` where ``axis`` includes the KV-head axis, over every KV head."""
    return self.model_sum(x.sum(axis, keepdims=keepdims))

  def heads_mean(self, x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """``x.mean(axis)`` over the KV-head ``axis``, over every KV head (shards hold equal counts)."""
    mean = x.mean(axis, keepdims=keepdims)
    return jax.lax.pmean(mean, self.model) if self.model else mean

  def heads_max(self, x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
    """``x.max(axis)`` where ``axis`` includes the KV-head axis, over every KV head."""
    top = x.max(axis, keepdims=keepdims)
    return jax.lax.pmax(top, self.model) if self.model else top

  def data_shard_key(self, key: jax.Array) -> jax.Array:
    """A random key of this data shard's own, so sequences on different shards draw apart."""
    return jax.random.fold_in(key, jax.lax.axis_index(self.data)) if self.data else key

  def any_anywhere(self, x: jax.Array) -> jax.Array:
    """``jnp.any(x)`` over the whole mesh: a branch or loop condition every shard agrees on."""
    local = jnp.any(x)
    if not self._all():
      return local
    return jax.lax.pmax(local.astype(jnp.int32), self._all()) > 0

  def all_anywhere(self, x: jax.Array) -> jax.Array:
    """``jnp.all(x)`` over the whole mesh (see ``any_anywhere``)."""
    return ~self.any_anywhere(~x)
