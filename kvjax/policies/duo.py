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
                                    written by ``kvjax.retrieval_heads.save_gates`` (read by ``policies.gates``)
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
import os
import pathlib
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.policies import gates as gates_lib
from kvjax.policies import layout as layout_lib
from kvjax.policies import selection
from kvjax.policies.base import Policy
from kvjax.policies.streaming_llm import StreamingLLM


@functools.lru_cache(maxsize=8)
def _load(gates: str) -> np.ndarray:
  """The gates [L, K] of a shipped model's name or a gates directory (a path that does
  not exist is said to be one, not taken for a model's name)."""
  is_path = os.path.isdir(gates) or pathlib.Path(gates).name != gates or gates.startswith("~")
  path = gates if is_path else gates_lib.shipped_gates_path(gates)
  values, _ = gates_lib.load_gates(path)
  return np.asarray(values, np.float32)


@dataclasses.dataclass(frozen=True)
class Duo(Policy):
  """Whole prompt in the heads with the highest gates, sinks + a recent window in the rest."""

  name: ClassVar[str] = "duo"
  chunked_prefill: ClassVar[bool] = False
  gates: str = "smollm2-135m-instruct"
  n_sink: int = 4
  recent: int = 60

  def __post_init__(self):
    if not isinstance(self.gates, str) or not self.gates:
      raise ValueError(f"policy 'duo': gates must be a shipped model's name or a directory, "
                       f"got {self.gates!r}")
    self._check_int("n_sink", 0)
    self._check_int("recent", 1)

  def reserved(self):
    return self.n_sink

  def gate_table(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """float32 [L, K] gates, checked against the model's shape (L: its global layers)."""
    gates = _load(self.gates)
    if gates.shape != (num_layers, num_kv_heads):
      raise ValueError(f"policy 'duo': gates {self.gates!r} are for {gates.shape[0]} layers x "
                       f"{gates.shape[1]} KV heads; this model has {num_layers} (global) x "
                       f"{num_kv_heads}. kvjax ships gates for {gates_lib.shipped()} "
                       "(duo:gates=NAME), or train them: python -m kvjax.retrieval_heads")
    return gates

  def head_budgets(self, budget: int, prompt_len: int, num_layers: int, num_kv_heads: int, *,
                   page_size: int, grow: int) -> np.ndarray:
    """int [L, K] entries each head keeps, in whole pages of ``page_size`` (each head
    taking ``grow`` entries after prefill) that sum to what every head at ``budget``
    would hold."""
    size, t = page_size, prompt_len
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

  def layout(self, budget, *, prompt_len, extra_tokens, max_new_tokens, page_size,
             num_kv_heads, windows):
    """Every global layer's heads sized by their gates (a capacity per head); no pool."""
    grow = extra_tokens + max_new_tokens
    kept = self.head_budgets(budget, prompt_len, layout_lib.num_global(windows), num_kv_heads,
                             page_size=page_size, grow=grow)
    capacity = -(-(kept + grow) // page_size) * page_size
    return layout_lib.with_rings(
        budget, (budget,) * len(kept), tuple(tuple(int(c) for c in row) for row in capacity),
        None, prompt_len=prompt_len, extra_tokens=extra_tokens, max_new_tokens=max_new_tokens,
        page_size=page_size, num_kv_heads=num_kv_heads, windows=windows)

  def score(self, ex, prompt, q, k, v):
    return StreamingLLM(n_sink=self.n_sink).score(ex, prompt, q, k, v)

  def select(self, ex, layout, layer_scores=None):
    # The gates cover the global layers; a ring layer keeps its window.
    del layer_scores
    global_layers = list(layout.global_layers)

    def select(layer, prompt, q, k, v):
      b, t, kh, _ = k.shape
      table = np.zeros((len(layout.windows), kh), np.int32)
      table[global_layers] = self.head_budgets(layout.budget, t, len(global_layers), kh,
                                               page_size=layout.page_size, grow=layout.grow)
      budgets = jnp.broadcast_to(jnp.asarray(table)[layer], (b, kh))
      keep = selection.keep_top(self.score(ex, prompt, q, k, v), budgets, int(table.max()))
      return selection.slots_from_keep(keep), None

    return select
