"""Block-quantized weights kept packed (GGUF's Q4_1 and Q8_0): formats and float32 references.

A packed matrix ``w [D_out, R]`` uint8 holds each output row's D_in weights as
D_in / 32 blocks, byte for byte as a GGUF file stores them (ggml's
``block_q4_1`` and ``block_q8_0``), 32 weights a block:

  Q4_1  f16 d, f16 m, 16 bytes of nibbles   w[j] = d * (q[j] & 15) + m,
                                            w[j + 16] = d * (q[j] >> 4) + m   (20 bytes)
  Q8_0  f16 d, 32 int8 q                    w[j] = d * q[j]                    (34 bytes)

The row width R = D_in / 32 * block bytes says which format a matrix is in,
given D_in (the activations' last axis), so a packed weight needs no tag:
``block_format(R, D_in)``. The references dequantize in float32 exactly as
``gguf.quants.dequantize`` does (``d * q`` is exact in float32, so the values
match it bit for bit) and multiply; the native CPU kernels
(``kvjax.kernels.native``) compute the same without writing the float weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BLOCK = 32  # weights per block, both formats


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  name: str
  ggml_type: int  # gguf.GGMLQuantizationType's value; the native kernels' format id
  block_bytes: int


Q4_1 = BlockFormat("Q4_1", 3, 20)
Q8_0 = BlockFormat("Q8_0", 8, 34)
FORMATS = {f.name: f for f in (Q4_1, Q8_0)}


def block_format(row_bytes: int, d_in: int) -> BlockFormat:
  """The format of packed rows of ``row_bytes`` bytes holding ``d_in`` weights each.

  Raises:
    ValueError: d_in is not a positive multiple of 32, or no format has that width.
  """
  if d_in <= 0 or d_in % BLOCK:
    raise ValueError(f"packed weights hold blocks of {BLOCK}: D_in={d_in} is not a multiple")
  for f in FORMATS.values():
    if row_bytes == d_in // BLOCK * f.block_bytes:
      return f
  widths = {f.name: d_in // BLOCK * f.block_bytes for f in FORMATS.values()}
  raise ValueError(f"packed rows of {row_bytes} bytes hold no known format for D_in={d_in} "
                   f"(expected one of {widths})")


def is_packed(w) -> bool:
  """Whether ``w`` is a packed block-quantized matrix (uint8) rather than float weights."""
  return jnp.dtype(w.dtype) == jnp.uint8


def _half(pair: jax.Array) -> jax.Array:
  """[..., 2] uint8 (little-endian f16) -> [...] float32."""
  return jax.lax.bitcast_convert_type(pair, jnp.float16).astype(jnp.float32)


def dequantize_reference(w: jax.Array, d_in: int) -> jax.Array:
  """Packed ``w [..., D_out, R]`` uint8 -> float32 ``[..., D_out, D_in]``."""
  fmt = block_format(w.shape[-1], d_in)
  blocks = w.reshape(*w.shape[:-1], d_in // BLOCK, fmt.block_bytes)
  d = _half(blocks[..., 0:2])[..., None]
  if fmt is Q4_1:
    m = _half(blocks[..., 2:4])[..., None]
    nibbles = blocks[..., 4:]
    q = jnp.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(jnp.float32)
    values = d * q + m
  else:
    q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    values = d * q
  return values.reshape(*w.shape[:-1], d_in)


def quantized_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x [..., D_in]`` float times packed ``w [D_out, R]`` -> float32 ``[..., D_out]`` = x @ W.T."""
  weights = dequantize_reference(w, x.shape[-1])
  return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), weights,
                    preferred_element_type=jnp.float32)
