"""Reductions that span a device mesh when generate's programs run on one.

A program on a mesh runs per shard (``jax.shard_map``): each device sees the
sequences of its data shard and the KV heads of its model shard. The few
steps that reduce over every sequence of a batch or over every KV head of a
layer call these functions, which reduce the local shard as before and then
across the mesh axis whose shards hold the rest. Outside a mesh (``on_axes``
not entered) each is its local reduction alone, so single-device programs
trace exactly as they always did.

This module is a leaf: the models, policies and decode state import it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import jax
import jax.numpy as jnp

_AXES = threading.local()  # .data, .model: the mesh axis names while tracing on a mesh


@contextlib.contextmanager
def on_axes(data: str | None, model: str | None) -> Iterator[None]:
  """Traces the body with sequences split over ``data`` and KV heads over ``model``."""
  saved = (getattr(_AXES, "data", None), getattr(_AXES, "model", None))
  _AXES.data, _AXES.model = data, model
  try:
    yield
  finally:
    _AXES.data, _AXES.model = saved


def local() -> contextlib.AbstractContextManager:
  """Traces the body with every reduction local, for arrays whose rows are not a
  batch's sequences and a layer's KV heads (a chunked prefill compresses each
  (sequence, KV head) as a one-head sequence of its own)."""
  return on_axes(None, None)


def _model() -> str | None:
  return getattr(_AXES, "model", None)


def _all() -> tuple[str, ...]:
  return tuple(a for a in (getattr(_AXES, "data", None), _model()) if a)


def model_sum(x: jax.Array) -> jax.Array:
  """The sum over model shards of a partial product (tensor parallelism's all-reduce)."""
  return jax.lax.psum(x, _model()) if _model() else x


def heads_sum(x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
  """``x.sum(axis)`` where ``axis`` includes the KV-head axis, over every KV head."""
  return model_sum(x.sum(axis, keepdims=keepdims))


def heads_mean(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
  """``x.mean(axis)`` over the KV-head ``axis``, over every KV head (shards hold equal counts)."""
  mean = x.mean(axis, keepdims=keepdims)
  return jax.lax.pmean(mean, _model()) if _model() else mean


def heads_max(x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
  """``x.max(axis)`` where ``axis`` includes the KV-head axis, over every KV head."""
  top = x.max(axis, keepdims=keepdims)
  return jax.lax.pmax(top, _model()) if _model() else top


def data_shard_key(key: jax.Array) -> jax.Array:
  """A random key of this data shard's own, so sequences on different shards draw apart."""
  data = getattr(_AXES, "data", None)
  return jax.random.fold_in(key, jax.lax.axis_index(data)) if data else key


def any_anywhere(x: jax.Array) -> jax.Array:
  """``jnp.any(x)`` over the whole mesh: a branch or loop condition every shard agrees on."""
  local = jnp.any(x)
  if not _all():
    return local
  return jax.lax.pmax(local.astype(jnp.int32), _all()) > 0


def all_anywhere(x: jax.Array) -> jax.Array:
  """``jnp.all(x)`` over the whole mesh (see ``any_anywhere``)."""
  return ~any_anywhere(~x)
