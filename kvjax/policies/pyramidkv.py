"""PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling
(arXiv 2406.02069).

SnapKV's token scores with per-layer budgets in an arithmetic progression:
lower layers, whose attention is spread widely, keep more; upper layers,
whose attention funnels onto few tokens, keep less.

Parameters:
  window   64      observation window, kept in every layer (kvpress's default)
  kernel   5       average-pooling width over token scores
  group    "mean"  reduction over the query heads of a KV head
  beta     20      the top layer keeps about budget / beta (kvpress's default)

Where the paper is silent or we differ from kvpress's PyramidKVPress
(docs/policies.md): layer budgets follow kvpress's ``get_layer_budget`` with
c = the budget, so the layers keep L x budget in total (up to rounding), and
every layer keeps the budget when the pyramid would dip below the window.
Budgets come from the padded prompt length (kvpress: the exact length), so
they are static.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.policies import layout as layout_lib
from kvjax.policies.base import Policy
from kvjax.policies.fields import WindowFields


@dataclasses.dataclass(frozen=True)
class PyramidKV(WindowFields, Policy):
  """SnapKV scores with layer budgets in an arithmetic progression (lower layers keep more)."""

  name: ClassVar[str] = "pyramidkv"
  beta: int = 20  # the top layer keeps about budget / beta (see layer_budgets)

  def __post_init__(self):
    super().__post_init__()
    self._check_int("beta", 1)

  def layout(self, budget, *, prompt_len, extra_tokens, max_new_tokens, page_size,
             num_kv_heads, windows):
    """The base layout with the pyramid's budget per global layer."""
    kept = self.layer_budgets(budget, prompt_len, layout_lib.num_global(windows))
    return layout_lib.uniform(kept, budget, growth=self.decode.growth(max_new_tokens),
                              prompt_len=prompt_len, extra_tokens=extra_tokens,
                              max_new_tokens=max_new_tokens, page_size=page_size,
                              num_kv_heads=num_kv_heads, windows=windows)

  def layer_budgets(self, budget, prompt_len, num_layers) -> tuple[int, ...]:
    """Entries each of ``num_layers`` layers keeps, top layer last."""
    # kvpress's PyramidKVPress.get_layer_budget, with c = the budget.
    c, w = float(budget), self.window
    low = c / self.beta
    high = 2 * c - low
    if high >= prompt_len - w:
      high = prompt_len - w
      low = 2 * c - high
    if not prompt_len >= high >= low >= w:
      return (max(1, round(c)),) * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return tuple(int(round(high - l * step)) for l in range(num_layers))
