"""Kernels: arrays in, arrays out. Each kernel sits beside a float32 jnp reference.

Installed as ``kvjax.kernels`` (the source folder is the top-level ``kernels/``).
"""

from kvjax.kernels.paged_attention import paged_attention_reference

__all__ = ["paged_attention_reference"]
