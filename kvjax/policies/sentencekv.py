"""SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching (arXiv 2504.00970),
simplified to an eviction policy.

The paper groups tokens into sentences, keeps a semantic vector per sentence
on the device and fetches a sentence's entries from the host when decoding
queries match it. Here the sentence is the unit of eviction: each head keeps
the observation window, then whole sentences by mean SnapKV score while they
fit, then the best single tokens, so it keeps exactly the budget.

Parameters:
  delimiter_ids  from the tokenizer  tokens whose decoded text ends with . ! ? newline 。！？
  window         64                  SnapKV's observation window, always kept
  kernel         5                   SnapKV's pooling width
  group          "mean"              reduction over the query heads of a KV head

Ours (the paper's retrieval is not done): sentences are cut after fixed
delimiter tokens, found from the tokenizer's text; a sentence scores the
mean of its tokens' SnapKV scores, and a sentence holding a NaN score is
never chosen whole; sentences are taken in score order until the next one
would overflow; the budget's rest goes to the best single tokens (static
shapes).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies import selection
from kvjax.policies.base import Policy
from kvjax.policies.fields import DelimiterFields
from kvjax.policies.fields import WindowFields


@dataclasses.dataclass(frozen=True)
class SentenceKV(DelimiterFields, WindowFields, Policy):
  """The window, whole sentences by mean SnapKV score while they fit, then the best tokens."""

  name: ClassVar[str] = "sentencekv"
  chunked_prefill: ClassVar[bool] = False  # segments from the prompt text

  def keep(self, ex, scores, prompt, budget, max_budget):
    del ex
    cut = self.is_delimiter(prompt.tokens)
    prefix, window = selection.regions(prompt.lengths, scores.shape[-1], self.window)
    seg = selection.segment_ids(cut)
    mean = selection.segment_mean(scores, seg, prefix)  # [B, K, T]
    # One unit per sentence, at its first token; its size is the sentence's length.
    starts = selection.segment_starts(seg)
    first = (starts == jnp.arange(seg.shape[1])) & prefix
    size = selection.gather_segments(selection.per_segment_sum(prefix.astype(jnp.int32), seg),
                                     seg)
    room = budget - jnp.sum(window, -1)[:, None, None]
    fits = selection.keep_whole(jnp.where(first[:, None], mean, -jnp.inf), size, room)
    # A token is in a kept sentence if its sentence's first token fits.
    whole = jnp.take_along_axis(fits, jnp.broadcast_to(starts[:, None], scores.shape), -1)
    chosen = (whole & prefix[:, None]) | window[:, None]
    rest = jnp.where(chosen | ~prefix[:, None], -jnp.inf, scores)
    top_up = selection.keep_top(rest, budget - chosen.sum(-1, keepdims=True), max_budget)
    return chosen | top_up
