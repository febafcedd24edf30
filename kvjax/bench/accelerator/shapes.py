"""The model shapes the preset builds random models of, shipped with the package.

The preset runs from an installed kvjax, so it reads no repository file: these
configs equal ``configs/llama3_2_1b.py`` and ``configs/smollm2_135m.py``
(``tests/test_bench_accelerator.py`` keeps them so). Another shape comes in
through ``--config=path/to/config.py`` (``scales.model_config``).
"""

from __future__ import annotations

from kvjax.models.config import LlamaConfig
from kvjax.models.config import RopeScaling

LLAMA3_2_1B = LlamaConfig(
    vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
    head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    max_position_embeddings=131072, tie_embeddings=True, name="Llama-3.2-1B")

SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_embeddings=True,
    name="Smollm2 135M 8k Lc100K Mix1 Ep2")

# The small scale's toy model: every section compiles in seconds on a CPU.
TINY = LlamaConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=64, intermediate_size=256,
                   max_position_embeddings=4096, name="tiny")

# A scale's model name -> its shape.
SHAPES = {"llama3_2_1b": LLAMA3_2_1B, "smollm2_135m": SMOLLM2_135M, "tiny": TINY}
