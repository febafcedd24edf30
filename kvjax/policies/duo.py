"""DuoAttention: retrieval heads and streaming heads (arXiv 2410.10819).

A gate per (layer, KV head), learned with optax on synthetic passkey data
(``kvjax.retrieval_heads``), says how much a head's output needs the whole
context: retrieval heads keep every token, streaming heads keep attention sinks
and a recent window. kvjax runs it at a budget, on the same KV bytes as any
other policy: the model's heads share L x K x budget entries (rounded to their
pages, as every policy's are); every head first takes the streaming share
(``n_sink + recent`` tokens, or the budget if smaller), then the heads in
decreasing gate order take the whole prompt, while the pages last; the head
where they run out keeps a longer recent window. Each head keeps its tokens by
StreamingLLM's rule (sinks, then the most recent), so a head given the whole
prompt keeps it all.

  kvjax.policies.get("duo")                             # the embedded model's gates
  kvjax.policies.get("duo", gates="/path/to/gates")     # trained with python -m kvjax.retrieval_heads

Parameters:
  gates    "smollm2-135m-instruct"  shipped gates of that model, or a directory
                                    written by ``kvjax.retrieval_heads.save_gates``
  n_sink   4    first tokens every head keeps (StreamingLLM's)
  recent   60   recent tokens of a streaming head

A model with sliding-window layers (Gemma 3) has gates for its global layers
only: its local layers keep their window as a ring, which no budget sizes.

Ours where the paper is silent: the paper sets the share of retrieval heads
by thresholding the gates and keeps the full cache in them; here the budget
sets how many heads the memory allows. Nothing is evicted while decoding (the
new tokens have their slots, as for SnapKV). The whole prompt is needed at
once (no chunked prefill), and every head's size differs, which a device mesh
does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.policies import selection
from kvjax.policies.base import Policy
from kvjax.policies.base import sized_field
from kvjax.policies.streaming_llm import StreamingLLM


@functools.lru_cache(maxsize=8)
def _load(gates: str) -> np.ndarray:
  """The gates [L, K] of a shipped model's name or a gates directory."""
  import os

  from kvjax.retrieval_heads import gates_io  # orbax: only when a duo run starts
  path = gates if os.path.isdir(gates) else gates_io.shipped_gates_path(gates)
  values, _ = gates_io.load_gates(path)
  return np.asarray(values, np.float32)


@dataclasses.dataclass(frozen=True)
class Duo(Policy):
  """Whole prompt in the heads with the highest gates, sinks + a recent window in the rest."""

  name: ClassVar[str] = "duo"
  chunked_prefill: ClassVar[bool] = False
  gates: str = "smollm2-135m-instruct"
  n_sink: int = 4
  recent: int = 60
  page_size: int = sized_field()  # the cache's (for_cache); 0: one slot per page
  grow: int = sized_field()  # entries each head takes after prefill (for_cache)

  def __post_init__(self):
    if not isinstance(self.gates, str) or not self.gates:
      raise ValueError(f"policy 'duo': gates must be a shipped model's name or a directory, "
                       f"got {self.gates!r}")
    self._check_int("n_sink", 0)
    self._check_int("recent", 1)

  def for_cache(self, *, page_size, grow):
    return dataclasses.replace(self, page_size=page_size, grow=grow)

  def reserved(self):
    return self.n_sink

  def gate_table(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """float32 [L, K] gates, checked against the model's shape (L: its global layers)."""
    gates = _load(self.gates)
    if gates.shape != (num_layers, num_kv_heads):
      from kvjax.retrieval_heads import gates_io  # pylint: disable=g-import-not-at-top
      raise ValueError(f"policy 'duo': gates {self.gates!r} are for {gates.shape[0]} layers x "
                       f"{gates.shape[1]} KV heads; this model has {num_layers} (global) x "
                       f"{num_kv_heads}. kvjax ships gates for {gates_io.shipped()} "
                       "(duo:gates=NAME), or train them: python -m kvjax.retrieval_heads")
    return gates

  def head_budgets(self, budget: int, prompt_len: int, num_layers: int,
                   num_kv_heads: int) -> np.ndarray:
    """int [L, K] entries each head keeps, in whole pages that sum to what every head
    at ``budget`` would hold."""
    size, grow, t = self.page_size or 1, self.grow, prompt_len
    pages = lambda n: -(-(n + grow) // size)
    gates = self.gate_table(num_layers, num_kv_heads).ravel()
    stream, whole = pages(min(budget, self.n_sink + self.recent)), pages(t)
    head_pages = np.full(gates.shape, stream)
    left = gates.size * (pages(budget) - stream)  # pages beyond every head's streaming share
    for head in np.argsort(-gates, kind="stable"):
      more = min(left, max(whole - stream, 0))
      head_pages[head] += more
      left -= more
    return np.minimum(head_pages * size - grow, t).reshape(num_layers, num_kv_heads)

  def capacity(self, **sizes):
    raise ValueError("policy 'duo' gives every KV head its own size (cache_layout): "
                     "kvjax.generate and the eval run it; the benchmark's cache does not")

  def cache_layout(self, num_kv_heads, *, budget, prompt_len, extra_tokens, max_new_tokens,
                   page_size, num_layers):
    sized = self.for_cache(page_size=page_size, grow=extra_tokens + max_new_tokens)
    kept = sized.head_budgets(budget, prompt_len, num_layers, num_kv_heads)
    grow = extra_tokens + max_new_tokens
    capacity = -(-(kept + grow) // page_size) * page_size
    return tuple(tuple(int(c) for c in row) for row in capacity), None

  def score(self, prompt, q, k, v):
    return StreamingLLM(n_sink=self.n_sink).score(prompt, q, k, v)

  def select(self, budget, layer_budgets):
    # The gates cover the global layers (budget > 0); a ring layer keeps its window.
    global_layers = [l for l, b in enumerate(layer_budgets) if b]

    def select(layer, prompt, q, k, v):
      b, t, kh, _ = k.shape
      table = np.zeros((len(layer_budgets), kh), np.int32)
      table[global_layers] = self.head_budgets(budget, t, len(global_layers), kh)
      budgets = jnp.broadcast_to(jnp.asarray(table)[layer], (b, kh))
      keep = selection.keep_top(self.score(prompt, q, k, v), budgets, int(table.max()))
      return selection.slots_from_keep(keep), None

    return select
