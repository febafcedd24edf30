"""Kernels: arrays in, arrays out. Each kernel sits beside a float32 jnp reference.

Installed as ``kvjax.kernels`` (the source folder is the top-level ``kernels/``).
As in JAX's Pallas ops, ``kvjax.kernels.paged_attention`` names the kernel
function here; import the module's other names from its full path.
"""

from kvjax.kernels.paged_attention import PagedAttentionBlockSizes
from kvjax.kernels.paged_attention import paged_attention
from kvjax.kernels.paged_attention import paged_attention_reference

__all__ = ["PagedAttentionBlockSizes", "paged_attention", "paged_attention_reference"]
