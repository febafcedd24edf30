"""Llama 3.2 1B: the shape of a llama3-scaled RoPE model (load its weights by path).

  kvjax.load("/path/to/Llama-3.2-1B-Instruct")   # a safetensors folder, or a .gguf
"""

from kvjax.models.config import LlamaConfig
from kvjax.models.config import RopeScaling


def get_config() -> LlamaConfig:
  return LlamaConfig(
      vocab_size=128256,
      hidden_size=2048,  # D
      num_layers=16,  # L
      num_heads=32,  # N
      num_kv_heads=8,  # K, G = 4
      head_dim=64,  # H
      intermediate_size=8192,  # F
      rms_norm_eps=1e-5,
      rope_theta=500000.0,
      rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192),
      max_position_embeddings=131072,
      tie_embeddings=True,
      name="Llama-3.2-1B",
  )
