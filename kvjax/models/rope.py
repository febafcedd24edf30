"""Rotary position embedding, rotate-half convention (as transformers' Llama).

Plain RoPE and the llama3 frequency scaling. Angles are computed in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig, theta: float | None = None) -> np.ndarray:
  """[H / 2] float32 inverse frequencies, llama3-scaled when configured.

  ``theta``: the base, if not ``config.rope_theta`` (Gemma 3's local layers).
  """
  h = config.head_dim
  theta = config.rope_theta if theta is None else theta
  inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
  s = config.rope_scaling
  if s is None:
    return inv.astype(np.float32)
  # Long wavelengths are stretched by `factor`, short ones kept, the band in
  # between interpolated (Llama 3.1's recipe).
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def cos_sin(config: LlamaConfig, positions: jax.Array,
            theta: float | None = None) -> tuple[jax.Array, jax.Array]:
  """positions [B, T] -> (cos, sin), each [B, T, H] float32 (``theta`` as in
  ``inverse_frequencies``)."""
  inv = inverse_frequencies(config, theta)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, T, heads, H] by cos/sin [B, T, H]."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)
