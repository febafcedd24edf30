"""Kernels: arrays in, arrays out. Each kernel sits beside a float32 jnp reference.

Installed as ``kvjax.kernels`` (the source folder is the top-level ``kernels/``).
As in JAX's Pallas ops, ``kvjax.kernels.paged_attention`` names the kernel
function here; import the module's other names from its full path.

  paged_attention   paged decode attention (weights and log-sum-exp on request)
  window_scores     observation-window scores with GQA aggregation and pooling,
                    key/value norms from the same pass (``token_norms`` alone)
  compact_slots     eviction: kept entries to the front of their pages, in place
                    or from dense entries; the pages past them freed
  platform          the TPU (Mosaic) / GPU (Triton) lowering choice

Without Pallas kernels (XLA on GPU/TPU, C++ on CPU):
  causal_attention  a prompt's causal attention (``causal_attention_reference``)
  quantized         packed GGUF blocks (Q4_1, Q8_0): formats, dequantization, products
  native            the C++ CPU kernels (``*_cpu.cc``), compiled on first use
"""

from kvjax.kernels.compaction import compact_slots
from kvjax.kernels.compaction import compact_slots_reference
from kvjax.kernels.paged_attention import PagedAttentionBlockSizes
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference
from kvjax.kernels.window_scoring import WindowScoringBlockSizes
from kvjax.kernels.window_scoring import token_norms
from kvjax.kernels.window_scoring import token_norms_reference
from kvjax.kernels.window_scoring import window_scores
from kvjax.kernels.window_scoring import window_scores_reference

__all__ = [
    "PagedAttentionBlockSizes",
    "WindowScoringBlockSizes",
    "compact_slots",
    "compact_slots_reference",
    "paged_attention",
    "paged_attention_reference",
    "token_norms",
    "token_norms_reference",
    "window_scores",
    "window_scores_reference",
]
