"""Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (arXiv 2407.11550).

A wrapper around a scoring policy: each layer keeps K x budget entries in
all, split across its K KV heads by where the inner policy's scores
concentrate. Every head first keeps its floor (its best ``floor x budget``
tokens, and never fewer than the inner policy always keeps: its observation
window); the rest of the layer's entries go to the best remaining scores of
all its heads at once (``selection.head_budgets``). The inner policy then
keeps, per head, its own choice under that head's budget: top-k for SnapKV,
whole segments and blocks for SABlock.

  kvjax.policies.get("adakv", inner="snapkv")          # or inner="sablock", ...
  --policies=adakv:inner=sablock:floor=0.1

Parameters:
  inner   "snapkv"  the scoring policy whose scores and keep rule are wrapped
  floor   0.2       share of the per-head budget every head keeps (the paper's
                    safeguard alpha, 0.2 in its experiments)
  window  0         the inner policy's observation window (0: its own default),
                    so that ``--window`` and ``adakv:window=16`` reach it

Unlike kvpress's AdaKVPress, which masks the evicted entries of a cache that
keeps every head at its longest, kvjax gives each head the pages its own
budget needs: the pool holds the layer's K x budget entries (plus up to one
partly filled page per head), not K x the largest head.

Ours where the paper is silent: the inner policy's scores are compared across
heads as they come (SnapKV's and SABlock's are attention weights, which sum to
one per query in every head); the inner policy keeps its observation window in
each head within the floor. Inner policies that choose their blocks outside
``keep`` (DynSplit-KV), evict during decode (PagedEviction, H2O, StreamingLLM)
or keep every token (full) are refused; so are a chunked prefill and a device
mesh (the split needs every head of a layer at once).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache.paged import round_up
from kvjax.policies import selection
from kvjax.policies.base import Full
from kvjax.policies.base import Policy
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
    elif type(inner).select is not Policy.select or inner.needs_every_layer:
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

  def layer_budgets(self, budget, prompt_len, num_layers):
    return self.inner.layer_budgets(budget, prompt_len, num_layers)

  def head_floor(self, budget):
    """Entries every head keeps at least (an int, or a traced scalar for a traced budget)."""
    share = self.floor * budget
    reserved = self.inner.reserved()
    if isinstance(budget, int):
      return min(budget, max(reserved, math.ceil(share)))
    return jnp.minimum(budget, jnp.maximum(reserved, jnp.ceil(share).astype(jnp.int32)))

  def capacity(self, **sizes):
    raise ValueError("policy 'adakv' sizes its cache from the number of KV heads "
                     "(cache_layout): kvjax.generate and the eval run it; the benchmark's "
                     "per-head cache does not")

  def cache_layout(self, num_kv_heads, *, budget, prompt_len, extra_tokens, max_new_tokens,
                   page_size, num_layers):
    """A head may take its layer's budget less every other head's floor; the pool holds
    the pages K heads with K x budget entries, each then adding ``grow``, can fill:
    head h fills ceil((n_h + grow) / S) pages, at most (K (budget + grow) + K (S - 1)) / S
    over the layer's heads as sum n_h <= K x budget."""
    k, grow = num_kv_heads, extra_tokens + max_new_tokens
    budgets = self.layer_budgets(budget, prompt_len, num_layers)
    capacity = tuple(round_up(k * b - (k - 1) * self.head_floor(b) + grow, page_size)
                     for b in budgets)
    return capacity, sum((k * (b + grow) + k * (page_size - 1)) // page_size for b in budgets)

  def score(self, prompt, q, k, v):
    return self.inner.score(prompt, q, k, v)

  def keep(self, scores, prompt, budget, max_budget):
    kh = scores.shape[1]
    budgets = selection.head_budgets(scores, kh * budget, self.head_floor(budget),
                                     kh * max_budget)
    return self.inner.keep(scores, prompt, budgets, kh * max_budget)
