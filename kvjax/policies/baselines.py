"""The field's baseline policies, built from the shared scoring and selection stages.

Defaults follow kvpress's presses where kvpress has one (window 64, pooling
kernel 5, 4 sinks, chunks of 20, beta 20); docs/policies.md lists every
difference. Budgets count the sinks and the observation window.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import EMPTY
from kvjax.policies import scoring
from kvjax.policies import selection
from kvjax.policies.base import Policy


def _slot_view(cache, pool):
  """A per-slot pool ([P, S_page]) seen per head: [B, L, K, S]."""
  b, l, k, _ = cache.page_table.shape
  return pool[jnp.maximum(cache.page_table, 0)].reshape(b, l, k, -1)


def _filled(cache):
  """bool [B, L, K, S]: slots holding an entry."""
  return jnp.arange(cache.max_slots) < cache.lengths[..., None]


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
  """Attention sinks + the most recent tokens; evicts the oldest non-sink while decoding.

  Keys keep the RoPE rotation of their original positions (kvpress's default).
  """

  name: ClassVar[str] = "streaming_llm"
  evicts_during_decode: ClassVar[bool] = True
  n_sink: int = 4  # first tokens always kept

  def __post_init__(self):
    self._check_int("n_sink", 0)

  def reserved(self):
    return self.n_sink

  def score(self, prompt, q, k, v):
    pos = prompt.positions.astype(jnp.float32)
    t = pos.shape[1]
    scores = jnp.where(pos < self.n_sink, float(t), pos)  # sinks first, then recency
    scores = jnp.where(jnp.arange(t)[None] < prompt.lengths[:, None], scores, -jnp.inf)
    return jnp.broadcast_to(scores[:, None], (k.shape[0], k.shape[2], t))

  def evict_slot(self, cache, positions):
    pos = _slot_view(cache, cache.positions)
    candidate = _filled(cache) & (pos >= self.n_sink)
    return jnp.argmin(jnp.where(candidate, pos, jnp.iinfo(jnp.int32).max), axis=-1)


@dataclasses.dataclass(frozen=True)
class SnapKV(Policy):
  """Observation-window attention, pooled, per KV head (kvpress SnapKVPress)."""

  name: ClassVar[str] = "snapkv"
  window: int = 64  # last prompt tokens whose queries score the rest; always kept
  kernel: int = 5  # average-pooling width over token scores
  group: str = "mean"  # reduction over the query heads of a KV head: mean or max

  def __post_init__(self):
    self._check_int("window", 1)
    self._check_int("kernel", 1, odd=True)
    _check_group(self)

  def reserved(self):
    return self.window

  def score(self, prompt, q, k, v):
    return scoring.snapkv_scores(q, k, prompt.lengths, window=self.window, kernel=self.kernel,
                                 group=self.group)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
  """SnapKV scores with layer budgets in an arithmetic progression (lower layers keep more).

  The total over layers equals L x budget (up to rounding). Budgets are fixed
  from the padded prompt length, so they are static.
  """

  name: ClassVar[str] = "pyramidkv"
  beta: int = 20  # the top layer keeps about budget / beta (see layer_budgets)

  def __post_init__(self):
    super().__post_init__()
    self._check_int("beta", 1)

  def layer_budgets(self, budget, prompt_len, num_layers):
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


@dataclasses.dataclass(frozen=True)
class KNorm(Policy):
  """Keeps the keys with the lowest L2 norm (kvpress KnormPress). No attention needed."""

  name: ClassVar[str] = "knorm"

  def score(self, prompt, q, k, v):
    scores = scoring.key_norm_scores(k)
    valid = jnp.arange(k.shape[1])[None, None] < prompt.lengths[:, None, None]
    return jnp.where(valid, scores, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class H2O(Policy):
  """Heavy hitters (accumulated attention) + a recent window; evicts one token per decode step."""

  name: ClassVar[str] = "h2o"
  chunked_prefill: ClassVar[bool] = False  # scores with every prompt query
  evicts_during_decode: ClassVar[bool] = True
  accumulates_attention: ClassVar[bool] = True
  recent: int = 32  # most recent tokens always kept (H2O's recent window)
  group: str = "mean"  # reduction over the query heads of a KV head

  def __post_init__(self):
    self._check_int("recent", 0)
    _check_group(self)

  def reserved(self):
    return self.recent

  def score(self, prompt, q, k, v):
    acc = scoring.accumulated_attention(q, k, prompt.lengths, group=self.group)
    valid = jnp.arange(k.shape[1])[None, None] < prompt.lengths[:, None, None]
    # The recent window is kept by selection, but the stored score stays the true sum.
    return jnp.where(valid, acc, -jnp.inf)

  def keep(self, scores, prompt, budget, max_budget):
    return selection.keep_top(scoring.force_window(scores, prompt.lengths, self.recent),
                              budget, max_budget)

  def evict_slot(self, cache, positions):
    pos = _slot_view(cache, cache.positions)
    acc = _slot_view(cache, cache.scores)
    recent = pos > (positions[:, None, None, None] - 1 - self.recent)
    candidate = _filled(cache) & ~recent
    return jnp.argmin(jnp.where(candidate, acc, jnp.inf), axis=-1)


@dataclasses.dataclass(frozen=True)
class ChunkKV(SnapKV):
  """Whole chunks of tokens by mean score; one index set for all heads of a layer.

  Chunk score = mean over the chunk of the KV-head-summed SnapKV scores
  (kvpress ChunkKVPress over SnapKVPress). Keeps budget // chunk_length chunks,
  so at most ``budget`` entries.
  """

  name: ClassVar[str] = "chunkkv"
  chunked_prefill: ClassVar[bool] = False  # chunks are spans of positions
  chunk_length: int = 20  # tokens per chunk

  def __post_init__(self):
    super().__post_init__()
    self._check_int("chunk_length", 1)

  def validate(self, budget):
    super().validate(budget)
    if budget < self.chunk_length:
      raise ValueError(f"budget {budget} is below one chunk of {self.chunk_length} tokens")

  def keep(self, scores, prompt, budget, max_budget):
    b, kh, t = scores.shape
    c = self.chunk_length
    num_chunks = -(-t // c)
    valid = jnp.arange(t)[None] < prompt.lengths[:, None]  # [B, T]
    summed = jnp.where(valid, scores.sum(1), 0.0)  # [B, T], over KV heads
    pad = num_chunks * c - t
    chunk_sum = jnp.pad(summed, ((0, 0), (0, pad))).reshape(b, num_chunks, c).sum(-1)
    chunk_len = jnp.pad(valid, ((0, 0), (0, pad))).reshape(b, num_chunks, c).sum(-1)
    chunk_score = jnp.where(chunk_len > 0, chunk_sum / jnp.maximum(chunk_len, 1), -jnp.inf)
    n_keep = max(1, max_budget // c)
    chosen = selection.keep_top(chunk_score[:, None], jnp.maximum(budget // c, 1), n_keep)[:, 0]
    keep = jnp.repeat(chosen, c, axis=-1)[:, :t] & valid  # [B, T]
    return jnp.broadcast_to(keep[:, None], scores.shape)


@dataclasses.dataclass(frozen=True)
class SentenceKV(SnapKV):
  """Whole sentences by mean SnapKV score, cut at fixed delimiter tokens.

  Sentences end after any token in ``delimiter_ids``. The window is kept; then
  whole sentences in order of mean score while they fit; the rest of the
  budget goes to the best single tokens left, so each head keeps exactly the
  budget.
  """

  name: ClassVar[str] = "sentencekv"
  chunked_prefill: ClassVar[bool] = False  # segments from the prompt text
  delimiter_ids: tuple[int, ...] = ()  # from delimiter_ids(tokenizer) when empty

  def __post_init__(self):
    super().__post_init__()
    ids = self.delimiter_ids
    if (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
      raise ValueError(f"policy {self.name!r}: delimiter_ids must be a sequence of token "
                       f"ids (ints >= 0), got {ids!r}")
    # A tuple, so the policy stays hashable (jit treats it as static).
    object.__setattr__(self, "delimiter_ids", tuple(ids))

  def bind(self, tokenizer):
    if self.delimiter_ids or tokenizer is None:
      return self
    return dataclasses.replace(self, delimiter_ids=delimiter_ids(tokenizer))

  def keep(self, scores, prompt, budget, max_budget):
    if not self.delimiter_ids or prompt.tokens is None:
      raise ValueError("sentencekv needs delimiter_ids (pass a tokenizer) and the prompt tokens")
    b, kh, t = scores.shape
    is_delim = jnp.isin(prompt.tokens, jnp.asarray(self.delimiter_ids))
    seg = selection.segment_ids(is_delim)
    pos = jnp.arange(t)[None]
    window = (pos >= (prompt.lengths - self.window)[:, None]) & (pos < prompt.lengths[:, None])
    prefix = pos < (prompt.lengths - self.window)[:, None]
    mean = selection.segment_mean(scores, seg, prefix)  # [B, K, T]
    # A sentence whose mean is NaN (a NaN score inside) ranks with the sentences
    # that cannot be chosen, and is never counted as fitting (below).
    mean = jnp.where(jnp.isnan(mean), -jnp.inf, mean)
    # Sentences in order of mean score; a sentence is kept whole if it fits.
    first = jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)), constant_values=True) & prefix
    seg_len = jax.ops.segment_sum(prefix.reshape(-1).astype(jnp.int32),
                                  (jnp.arange(b)[:, None] * t + seg).reshape(-1), b * t)
    seg_len = seg_len.reshape(b, t)  # [B, T_seg]
    order_key = jnp.where(first[:, None], mean, -jnp.inf)  # one entry per sentence
    order = jnp.argsort(-order_key, axis=-1)  # [B, K, T]: sentence-start tokens first
    sorted_len = jnp.take_along_axis(
        jnp.broadcast_to(jnp.take_along_axis(seg_len, seg, -1)[:, None], scores.shape),
        order, -1)
    choosable = jnp.take_along_axis(order_key, order, -1) > -jnp.inf
    sorted_len = jnp.where(choosable, sorted_len, 0)
    room = budget - jnp.sum(window, -1)[:, None, None]
    fits_sorted = (jnp.cumsum(sorted_len, -1) <= room) & choosable
    fits = jnp.zeros(scores.shape, bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], order].set(fits_sorted)
    # A token is in a kept sentence if its sentence's first token fits.
    start_of = jnp.broadcast_to(_first_index(seg)[:, None], scores.shape)
    whole = jnp.take_along_axis(fits, start_of, -1) & prefix[:, None]
    chosen = whole | window[:, None]
    rest = jnp.where(chosen | ~prefix[:, None], -jnp.inf, scores)
    top_up = selection.keep_top(rest, budget - chosen.sum(-1, keepdims=True), max_budget)
    return chosen | top_up


def _check_group(policy) -> None:
  if policy.group not in scoring.GROUP_REDUCTIONS:
    raise ValueError(f"policy {policy.name!r}: group must be one of "
                     f"{scoring.GROUP_REDUCTIONS}, got {policy.group!r}")


def _first_index(seg):
  """[B, T] segment ids -> [B, T] index of the first token of each token's segment."""
  t = seg.shape[1]
  idx = jnp.broadcast_to(jnp.arange(t), seg.shape)
  start = jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)), constant_values=True)
  return jax.lax.cummax(jnp.where(start, idx, 0), axis=1)


SENTENCE_END = (".", "!", "?", "\n", "。", "！", "？")


@functools.lru_cache(maxsize=8)
def _delimiter_ids_cached(tokenizer, chars):
  ids = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode([i], skip_special_tokens=True).rstrip(" ")
    if text and text[-1] in chars:
      ids.append(i)
  return tuple(ids)


def delimiter_ids(tokenizer, chars: tuple[str, ...] = SENTENCE_END) -> tuple[int, ...]:
  """Ids of the tokens whose text ends a sentence (decoded text, not fixed ids)."""
  return _delimiter_ids_cached(tokenizer, tuple(chars))


BASELINES = (StreamingLLM, SnapKV, PyramidKV, KNorm, H2O, ChunkKV, SentenceKV)
