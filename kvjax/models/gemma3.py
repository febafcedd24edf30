"""Gemma 3 (text) in Flax NNX, built from the Llama decoder's parts.

What differs from kvjax.models.llama (see Gemma3Config): the embedding is
scaled by sqrt(D); RMS norms wrap both attention and the MLP (before and
after); the MLP is GeGLU with tanh-approximated GELU; q and k are RMS-normed
per head; local layers (five of every six in Gemma 3) attend to their last
``sliding_window`` positions and rotate with their own RoPE base; the logits
may be soft-capped.

Attention still goes through ``attend(state, layer, q, k, v)`` with the
signature and shapes of kvjax.models.llama, so the paged cache plugs in
unchanged. Queries are pre-scaled by sqrt(H / query_pre_attn_scalar) so that
the hook's 1/sqrt(H) gives Gemma's 1/sqrt(query_pre_attn_scalar) (a factor of
1 for every released Gemma 3 but the 27B). Which layers are local is static:
``config.layer_windows[layer]`` (0 on global layers). The hook must apply
that window itself: the paged cache holds those layers as rings of their
window (``kvjax.cache.PagedKVCache``'s ``windows``), and ``reference_attend``
masks them in a cacheless forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.cache.attention import layer_window, prompt_attention
from kvjax.models import rope as rope_lib
from kvjax.models.config import Gemma3Config, LlamaConfig
from kvjax.models.llama import AttendFn, DecoderLayer, Llama, RMSNorm, matmul


def _pick(table: tuple, layer) -> jax.Array | bool:
  """table[layer] for a Python int layer (unrolled) or a traced one (scanned)."""
  if isinstance(layer, int):
    return table[layer]
  return jnp.asarray(table)[layer]


class Gemma3DecoderLayer(DecoderLayer):
  """x + post_norm(attn(norm(x))), then x + post_norm(GeGLU(norm(x)))."""

  def __init__(self, config: Gemma3Config, *, dtype, rngs):
    super().__init__(config, dtype=dtype, rngs=rngs)
    d, eps = config.hidden_size, config.rms_norm_eps
    self.post_attn_norm = RMSNorm(d, eps, dtype=dtype)
    self.post_mlp_norm = RMSNorm(d, eps, dtype=dtype)

  def __call__(self, x, cos, sin, state, layer, attend: AttendFn, ex):
    """As DecoderLayer's, with cos and sin [2, B, T, H]: the global then the local table."""
    c = self.config
    b, t, _ = x.shape
    local = _pick(c.local_layers, layer)
    if isinstance(local, bool):
      cos, sin = cos[int(local)], sin[int(local)]
    else:
      cos, sin = jnp.where(local, cos[1], cos[0]), jnp.where(local, sin[1], sin[0])
    q, k, v = self.qkv(self.attn_norm(x), cos, sin, ex)
    q_scale = math.sqrt(c.head_dim / c.query_pre_attn_scalar)
    if q_scale != 1.0:
      q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
    state, attn = attend(state, layer, q, k, v)
    # On a mesh each shard holds a partial sum: the post-norm comes after the sum.
    out = ex.axes.model_sum(matmul(attn.reshape(b, t, -1), self.wo[...], ex))
    x = x + self.post_attn_norm(out)
    gate, up = jnp.split(matmul(self.mlp_norm(x), self.w_gate_up[...], ex), 2, axis=-1)
    hidden = jax.nn.gelu(gate, approximate=True) * up
    x = x + self.post_mlp_norm(ex.axes.model_sum(matmul(hidden, self.w_down[...], ex)))
    return x, state


class Gemma3(Llama):
  """Gemma 3 decoder: Llama's module with Gemma's layer, embedding scale, RoPE and logits."""

  layer_class = Gemma3DecoderLayer

  def __init__(self, config: Gemma3Config, **kwargs):
    if not isinstance(config, Gemma3Config):
      raise TypeError(f"Gemma3 needs a Gemma3Config, got {type(config).__name__}")
    super().__init__(config, **kwargs)

  def embed_tokens(self, tokens: jax.Array, ex) -> jax.Array:
    x = super().embed_tokens(tokens, ex)
    # Rounded to the activations' dtype first, as Gemma's reference does.
    return x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)

  def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[2, B, T, H] cos and sin: global layers' base (index 0), local layers' (index 1)."""
    tables = [rope_lib.cos_sin(self.config, positions, theta)
              for theta in (self.config.rope_theta, self.config.rope_local_theta)]
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])

  def logits(self, hidden: jax.Array, ex=None) -> jax.Array:
    logits = super().logits(hidden, ex)
    cap = self.config.final_logit_softcapping
    if cap is not None:
      logits = cap * jnp.tanh(logits / cap)
    return logits


def reference_attend(config: LlamaConfig, ex=None) -> AttendFn:
  """The ``attend`` of a forward without a cache: causal, windowed on local layers
  (``kvjax.cache.attention.prompt_attention``, run as ``ex`` says)."""

  def attend(state, layer, q, k, v):
    window, local = layer_window(config.layer_windows, layer)
    return state, prompt_attention(q, k, v, window=window, local=local, ex=ex)

  return attend


def module_class(config: LlamaConfig) -> type[Llama]:
  """The Flax module that runs ``config``: Gemma3 for a Gemma3Config, else Llama."""
  return Gemma3 if isinstance(config, Gemma3Config) else Llama
