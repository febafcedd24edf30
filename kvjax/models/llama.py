"""A Llama-family decoder in Flax NNX (SmolLM2, Llama 3.x, Mistral, Qwen2, Qwen3).

Two layouts of the layers (``scan_layers``):
  True   stacked along a leading L axis and run under ``jax.lax.scan``: a
         30-layer model compiles as fast as a 1-layer one.
  False  one module (and arrays) per layer, the layers unrolled. Each program
         compiles several times slower, but a scan step copies its layer's
         weight slice out of the stacked arrays before the matmuls, and a
         one-token decode step reads each weight once: the copy costs about
         as much as the matmuls (docs/accelerators.md has the figures).
  None   (the default) False on GPU and TPU, where the decode step is the
         cost that matters and compilation is fast; True on CPU, where
         compilation is slow (``default_scan_layers``).

Matrices are float (``[D_in, D_out]``; the embedding ``[V, D]``) or packed
GGUF blocks (``[D_out, R]`` uint8, ``kvjax.kernels.quantized``; the embedding
``[V, R]``), as ``kvjax.load(..., packed=True)`` keeps them: ``matmul`` and
``embed`` read either, the packed ones through the kernels of the execution
they are given (``kvjax.execution.Execution``).

Attention is delegated to an ``attend`` function, which is how the paged cache
(kvjax.cache) plugs in:

  attend(state, layer, q, k, v) -> (state, out)
    q [B, T, N, H], k/v [B, T, K, H] with RoPE applied, out [B, T, N, H].

A user's own Flax model can call the same cache entry points (see
kvjax.cache.prefill_attention / decode_attention).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax import execution
from kvjax.kernels import quantized
from kvjax.models import rope as rope_lib
from kvjax.models.config import LlamaConfig
from kvjax.models.config import ShardingRules

AttendFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[Any, jax.Array]]


def _dense(rngs: nnx.Rngs, d_in: int, d_out: int, dtype) -> nnx.Param:
  init = jax.nn.initializers.normal(stddev=d_in ** -0.5)
  return nnx.Param(init(rngs.params(), (d_in, d_out), dtype))


def matmul(x: jax.Array, w: jax.Array, ex: execution.Execution) -> jax.Array:
  """x [..., D_in] times a layer matrix: float w [D_in, D_out], or packed rows [D_out, R]
  (``ex``'s ``quantized_matmul``)."""
  if quantized.is_packed(w):
    return ex.impl("quantized_matmul")(x, w).astype(x.dtype)
  return x @ w


def embed(table: jax.Array, tokens: jax.Array, width: int, dtype,
          ex: execution.Execution) -> jax.Array:
  """Rows of the embedding (float [V, D], or packed [V, R]) for tokens [B, T] -> [B, T, D]."""
  rows = table[tokens]
  if not quantized.is_packed(table):
    return rows
  flat = rows.reshape(-1, rows.shape[-1])
  return ex.impl("dequantize")(flat, width).reshape(*tokens.shape, width).astype(dtype)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32."""

  def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then x + SwiGLU(norm(x))."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    c = config
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    self.config = c
    self.attn_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
    # q, k and v side by side in one matrix, and gate beside up: a layer's
    # weights are read in 4 products instead of 7 (docs/results/README.md,
    # "Design choices"). Checkpoints keep the parts apart
    # (kvjax.models.lm.build_params joins them).
    self.wqkv = _dense(rngs, d, (n + 2 * k) * h, dtype)
    self.wo = _dense(rngs, n * h, d, dtype)
    if c.attention_bias:
      self.bqkv = nnx.Param(jnp.zeros(((n + 2 * k) * h,), dtype))
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
      self.k_norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
    self.mlp_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
    self.w_gate_up = _dense(rngs, d, 2 * f, dtype)
    self.w_down = _dense(rngs, f, d, dtype)

  def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ex: execution.Execution):
    """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H], RoPE applied."""
    c = self.config
    b, t, _ = x.shape
    qkv = matmul(x, self.wqkv[...], ex)
    if c.attention_bias:
      qkv = qkv + self.bqkv[...]
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q = qkv[..., :q_dim].reshape(b, t, c.num_heads, c.head_dim)
    k = qkv[..., q_dim:q_dim + kv_dim].reshape(b, t, c.num_kv_heads, c.head_dim)
    v = qkv[..., q_dim + kv_dim:].reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return rope_lib.apply(q, cos, sin), rope_lib.apply(k, cos, sin), v

  def __call__(self, x, cos, sin, state, layer, attend: AttendFn, ex: execution.Execution):
    b, t, _ = x.shape
    q, k, v = self.qkv(self.attn_norm(x), cos, sin, ex)
    state, attn = attend(state, layer, q, k, v)
    # On a mesh each model shard holds some heads and MLP columns: a partial sum.
    x = x + ex.axes.model_sum(matmul(attn.reshape(b, t, -1), self.wo[...], ex))
    gate, up = jnp.split(matmul(self.mlp_norm(x), self.w_gate_up[...], ex), 2, axis=-1)
    x = x + ex.axes.model_sum(matmul(jax.nn.silu(gate) * up, self.w_down[...], ex))
    return x, state


def default_scan_layers(scan_layers: bool | None = None) -> bool:
  """``scan_layers`` as given, or for None the default device's layout: unrolled
  (False) on GPU and TPU, scanned (True) on CPU (see the module docstring)."""
  if scan_layers is None:
    return jax.default_backend() not in ("gpu", "tpu")
  return bool(scan_layers)


class Llama(nnx.Module):
  """Decoder-only transformer.

  ``layers`` holds L stacked DecoderLayers (``scan_layers`` true), else a list
  of L; ``scan_layers=None`` picks by the default device (``default_scan_layers``).
  Subclasses (kvjax.models.gemma3) change the layer class, the embedding's
  scale, the RoPE tables and the logits, and keep the loop over layers.
  """

  layer_class = DecoderLayer
  # How a mesh's model axis splits the weights (kvjax.sharding.layout applies it):
  # the fused q/k/v and gate/up columns by head and MLP column, the output and down
  # projections by their input rows; the norms and embeddings are replicated.
  sharding_rules = ShardingRules(head_columns=("wqkv", "bqkv"), mlp_columns=("w_gate_up",),
                                 row_split=("wo", "w_down"))

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
               scan_layers: bool | None = None):
    self.config = config
    self.scan_layers = scan_layers = default_scan_layers(scan_layers)
    self.embed = nnx.Param(
        jax.nn.initializers.normal(1.0)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))

    if scan_layers:
      @nnx.split_rngs(splits=config.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_layers(layer_rngs):
        return self.layer_class(config, dtype=dtype, rngs=layer_rngs)

      self.layers = make_layers(rngs)
    else:
      self.layers = nnx.List(
          [self.layer_class(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
    if not config.tie_embeddings:
      self.lm_head = _dense(rngs, config.hidden_size, config.vocab_size, dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array, state: Any, attend: AttendFn,
               ex: execution.Execution | None = None):
    """Runs every layer.

    Args:
      tokens: [B, T] int32; positions: [B, T] int32 RoPE positions.
      state: threaded through ``attend`` (a PagedKVCache, or None).
      ex: the execution of the packed weights' products and the mesh's sums
        (None: ``kvjax.execution.ambient()``); ``attend`` brings its own.

    Returns:
      (hidden [B, T, D] after the final norm, state).
    """
    ex = execution.of(ex)
    x = self.embed_tokens(tokens, ex)
    cos, sin = self.rope_tables(positions)
    if not self.scan_layers:
      for i, layer in enumerate(self.layers):
        x, state = layer(x, cos, sin, state, i, attend, ex)
      return self.final_norm(x), state
    graphdef, stacked = nnx.split(self.layers)

    def body(carry, xs):
      x, state = carry
      layer_params, layer = xs
      x, state = nnx.merge(graphdef, layer_params)(x, cos, sin, state, layer, attend, ex)
      return (x, state), None

    layers = jnp.arange(self.config.num_layers)
    (x, state), _ = jax.lax.scan(body, (x, state), (stacked, layers))
    return self.final_norm(x), state

  def embed_tokens(self, tokens: jax.Array, ex: execution.Execution) -> jax.Array:
    """tokens [B, T] -> the first layer's input [B, T, D]."""
    return embed(self.embed[...], tokens, self.config.hidden_size,
                 self.final_norm.scale[...].dtype, ex)

  def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> the (cos, sin) every layer receives, each [B, T, H]."""
    return rope_lib.cos_sin(self.config, positions)

  def logits(self, hidden: jax.Array, ex: execution.Execution | None = None) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (``ex``: as for ``__call__``)."""
    table = self.embed[...] if self.config.tie_embeddings else self.lm_head[...]
    if quantized.is_packed(table):  # [V, R] rows either way
      return execution.of(ex).impl("quantized_matmul")(hidden, table)
    if self.config.tie_embeddings:
      # Contract the embedding's own D axis: written as embed.T, XLA:CPU
      # transposes the [V, D] matrix inside the product (docs/results/README.md,
      # "Design choices").
      return jnp.einsum("...d,vd->...v", hidden, table, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, table, preferred_element_type=jnp.float32)
