"""Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (arXiv 2407.11550).

A wrapper around a scoring policy: each layer keeps K x budget entries in
all, split across its K KV heads by where the inner policy's scores
concentrate. Every head first keeps its floor (its best ``floor x budget``
tokens, and never fewer than the inner policy always keeps: its observation
window); the rest of the layer's entries go to the best remaining scores of
all its heads at once (``selection.head_budgets``). The inner policy then
keeps, per head, its own choice under that head's budget: top-k for SnapKV,
whole segments and blocks for SABlock and DynSplit-KV.

  kvjax.policies.get("adakv", inner="snapkv")          # or "sablock", "dynsplit_kv", ...
  --policies=adakv:inner=sablock:floor=0.1

Parameters:
  inner   "snapkv"  the scoring policy whose scores and keep rule are wrapped
  floor   0.2       share of the per-head budget every head keeps (the paper's
                    safeguard alpha, 0.2 in its experiments)
  window  0         the inner policy's observation window (0: its own default),
                    so that ``--window`` and ``adakv:window=16`` reach it

Unlike kvpress's AdaKVPress, which masks the evicted entries of a cache that
keeps every head at its longest, kvjax gives each head the pages its own
budget needs, in whole pages: a layer's heads share exactly the pages the
inner policy alone would give them (K x ceil((budget + grow) / page) for
``grow`` entries appended after prefill), so both hold the same KV bytes. Its
heads' budgets sum to what those pages hold, K x budget when budget + grow
fills whole pages (``selection.whole_pages``).

Ours where the paper is silent: the inner policy's scores are compared across
heads as they come (SnapKV's and SABlock's are attention weights, which sum to
one per query in every head); the inner policy keeps its observation window in
each head within the floor. Inner policies that choose their entries outside
``keep`` (Duo; DynSplit-KV takes the split in its own ``select``), evict
during decode (PagedEviction, H2O, StreamingLLM) or keep every token (full)
are refused; so are a chunked prefill and a device mesh (the split needs every
head of a layer at once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.paged import round_up
from kvjax.policies import layout as layout_lib
from kvjax.policies import selection
from kvjax.policies.base import Full
from kvjax.policies.base import Policy
from kvjax.policies.base import keep_by
from kvjax.policies.dynsplit import DynSplitKV
from kvjax.policies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class AdaKV(Policy):
  """A layer's budget split across its KV heads by where the inner policy's scores concentrate."""

  name: ClassVar[str] = "adakv"
  chunked_prefill: ClassVar[bool] = False
  inner: Policy = SnapKV()  # kvjax.policies.get takes its name too: get("adakv", inner="sablock")
  floor: float = 0.2
  window: int = 0  # the inner policy's observation window; 0 = its own

  def __post_init__(self):
    inner = self.inner
    if not isinstance(inner, Policy):
      raise ValueError(f"policy 'adakv': inner must be a policy (kvjax.policies.get takes "
                       f"its name), got {inner!r}")
    self._check_int("window", 0)
    if self.window:
      if "window" not in {f.name for f in dataclasses.fields(inner)}:
        raise ValueError(f"policy 'adakv': window={self.window} but {inner.name!r} has no "
                         "observation window")
      inner = dataclasses.replace(inner, window=self.window)
    why = None
    if isinstance(inner, (Full, AdaKV)):
      why = "it keeps no budget of its own to split"
    elif inner.evicts_during_decode or inner.accumulates_attention:
      why = "it evicts during decode, where every head holds the same budget"
    elif (type(inner).select is not Policy.select or inner.needs_every_layer) and not isinstance(
        inner, DynSplitKV):
      why = "it chooses its entries outside keep()"
    if why:
      raise ValueError(f"policy 'adakv' cannot wrap {inner.name!r}: {why}")
    object.__setattr__(self, "inner", inner)
    self._check_number("floor", 0.0, 1.0 + 1e-9)

  def bind(self, tokenizer):
    return dataclasses.replace(self, inner=self.inner.bind(tokenizer))

  def reserved(self):
    return self.inner.reserved()

  def validate(self, budget):
    self.inner.validate(budget)

  def head_floor(self, budget):
    """Entries every head keeps at least (an int, or a traced scalar for a traced budget)."""
    share = self.floor * budget
    reserved = self.inner.reserved()
    if isinstance(budget, int):
      return min(budget, max(reserved, math.ceil(share)))
    return jnp.minimum(budget, jnp.maximum(reserved, jnp.ceil(share).astype(jnp.int32)))

  def head_pages(self, budget, page_size: int, grow: int):
    """(pages of a head of the inner policy, pages of a head at the floor) for a budget,
    each head taking ``grow`` entries after prefill."""
    return -(-(budget + grow) // page_size), -(-(self.head_floor(budget) + grow) // page_size)

  def layout(self, budget, *, prompt_len, extra_tokens, max_new_tokens, page_size,
             num_kv_heads, windows):
    """The pool holds the inner policy's pages; a head may take all of its layer's
    pages but the other heads' floors."""
    sizes = dict(prompt_len=prompt_len, extra_tokens=extra_tokens,
                 max_new_tokens=max_new_tokens, page_size=page_size,
                 num_kv_heads=num_kv_heads, windows=windows)
    inner = self.inner.layout(budget, **sizes)
    kept = tuple(inner.budgets[l] for l in inner.global_layers)
    k, grow = num_kv_heads, extra_tokens + max_new_tokens
    pages = [self.head_pages(b, page_size, grow) for b in kept]
    capacity = tuple((k * p - (k - 1) * f) * page_size for p, f in pages)
    return layout_lib.with_rings(budget, kept, capacity, sum(k * p for p, _ in pages), **sizes)

  def score(self, ex, prompt, q, k, v):
    return self.inner.score(ex, prompt, q, k, v)

  def head_split(self, layout, scores, budget, max_budget: int):
    """(each head's budget [B, K], their static bound) from the inner policy's scores
    [B, K, T] and the layer's budget per head, in whole pages of ``layout``."""
    kh, size, grow = scores.shape[1], layout.page_size, layout.grow
    pages, floor_pages = self.head_pages(budget, size, grow)
    max_total = kh * (round_up(max_budget + grow, size) - grow)
    tokens = selection.head_budgets(scores, kh * (pages * size - grow),
                                    floor_pages * size - grow, max_total)
    return selection.whole_pages(tokens, kh * pages, size, grow), max_total

  # DynSplit-KV chooses its blocks in its own select; it takes the split there.
  @property
  def needs_every_layer(self):
    return self.inner.needs_every_layer

  def select(self, ex, layout, layer_scores=None):
    split = functools.partial(self.head_split, layout)
    if isinstance(self.inner, DynSplitKV):
      return self.inner.select(ex, layout, head_split=split)

    def keep(ex, scores, prompt, budget, max_budget):
      return self.inner.keep(ex, scores, prompt, *split(scores, budget, max_budget))

    return keep_by(self, ex, layout, keep, layer_scores)

  def select_recorded(self, ex, layout, prompt, recorded):
    if isinstance(self.inner, DynSplitKV):
      return self.inner.select_recorded(ex, layout, prompt, recorded,
                                        head_split=functools.partial(self.head_split, layout))
    return super().select_recorded(ex, layout, prompt, recorded)
