"""SnapKV: LLM Knows What You are Looking for Before Generation (arXiv 2404.14469).

The last ``window`` prompt tokens are an observation window: their queries
attend over the prompt, and each KV head keeps the window plus the tokens
those queries weighed most (window-averaged attention, average-pooled so a
kept token brings its neighbours).

Parameters:
  window   64      observation window, kept and counted in the budget (kvpress's default)
  kernel   5       average-pooling width over token scores (kvpress's default)
  group    "mean"  reduction over the query heads of a KV head ("mean" or "max")

Where the paper is silent or we differ from kvpress's SnapKVPress
(docs/policies.md): GQA scores are reduced per KV head, never repeated per
query head (``group``, mean as kvpress); the window scores max + 1, the max
taken over the sequence's own heads rather than the whole batch, so a
sequence's result does not depend on its batch; the budget is a count of
entries, not a compression ratio.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.policies import scoring
from kvjax.policies.base import Policy
from kvjax.policies.fields import WindowFields


@dataclasses.dataclass(frozen=True)
class SnapKV(WindowFields, Policy):
  """Observation-window attention, pooled, per KV head (kvpress SnapKVPress)."""

  name: ClassVar[str] = "snapkv"

  def score(self, ex, prompt, q, k, v):
    """s[b, h, t] = reduce_{n in group h} avgpool_kernel(mean_{i in window}
    softmax_t(q[b, i, n] . k[b, :, h] / sqrt(H)))[t]: [B, K, T].

    The window's own tokens then score max + 1 (always kept), padding -inf.
    One op (``window_scores``, kernels/window_scoring.py) computes the
    softmax over the causal prefix, the window mean, the pooling and the
    group reduction, without a [T, T] matrix.
    """
    del v
    attention = ex.impl("window_scores")(q, k, prompt.lengths, window=self.window,
                                         pool=self.kernel, group=self.group)
    return scoring.force_window(ex, attention, prompt.lengths, self.window)
