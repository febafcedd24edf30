"""Model configuration for Llama-family decoders.

Dimension names used across kvjax (written once, used everywhere):
  B batch, T tokens, S cache slots, N query heads, K kv heads, G group (N // K),
  H head dim, D model width, F MLP width, V vocabulary, P pages, L layers.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x frequency scaling of RoPE ("llama3" rope_type in transformers)."""

  factor: float = 8.0  # how much the context was stretched
  low_freq_factor: float = 1.0  # wavelengths above original/low_freq are divided by factor
  high_freq_factor: float = 4.0  # wavelengths below original/high_freq are kept
  original_max_position_embeddings: int = 8192  # context of the unscaled model

  def __post_init__(self):
    if self.factor <= 0 or self.low_freq_factor <= 0:
      raise ValueError(f"RopeScaling factors must be positive, got {self}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"high_freq_factor ({self.high_freq_factor}) must exceed "
          f"low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a Llama-family decoder (SmolLM2, Llama 3.x, Mistral)."""

  vocab_size: int  # V
  hidden_size: int  # D
  num_layers: int  # L
  num_heads: int  # N query heads
  num_kv_heads: int  # K key/value heads; N must be a multiple of K (GQA)
  head_dim: int  # H
  intermediate_size: int  # F, SwiGLU width
  rms_norm_eps: float = 1e-5  # epsilon inside RMSNorm
  rope_theta: float = 10000.0  # RoPE base
  rope_scaling: RopeScaling | None = None  # llama3 scaling, None for plain RoPE
  max_position_embeddings: int = 8192  # longest context the model was trained for
  tie_embeddings: bool = True  # lm_head shares the embedding matrix
  attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
  name: str = "llama"  # for messages and result rows

  def __post_init__(self):
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "intermediate_size"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
          f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def group_size(self) -> int:
    """G: query heads per KV head."""
    return self.num_heads // self.num_kv_heads
