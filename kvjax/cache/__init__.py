"""The paged KV cache and the attention entry points models call."""

from kvjax.cache.attention import Prompt
from kvjax.cache.attention import SelectFn
from kvjax.cache.attention import causal_attention
from kvjax.cache.attention import chunk_attention
from kvjax.cache.attention import decode_attention
from kvjax.cache.attention import extend_attention
from kvjax.cache.attention import keep_all
from kvjax.cache.attention import prefill_attention
from kvjax.cache.attention import store_prompt
from kvjax.cache.paged import EMPTY
from kvjax.cache.paged import PagedKVCache

__all__ = [
    "EMPTY",
    "PagedKVCache",
    "Prompt",
    "SelectFn",
    "causal_attention",
    "chunk_attention",
    "decode_attention",
    "extend_attention",
    "keep_all",
    "prefill_attention",
    "store_prompt",
]
