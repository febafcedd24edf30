"""SABlock: Semantic-Aware KV Cache Eviction with Adaptive Compression Block Size
(arXiv 2510.22556).

The prompt is ``compressible region | observation window``; the window is
always kept and its queries score the rest. Per layer:

  1. segments: cut after tokens whose decoded text ends a clause or sentence
     (. , ; : ! ? newline, CJK punctuation), capped at ``max_segment`` tokens,
     pieces shorter than ``min_segment`` merged into the next segment
     (kernels/segmentation.py);
  2. token score s_t: SnapKV-style window attention per KV head; segment-guided
     score s'_t = s_t + gamma * mean of s over t's segment;
  3. budget to segments: segments ranked by their mean s'; whole segments
     kept in that order while they fit the budget left by the window; the
     first one that does not fit is the partial segment and gets what is left;
  4. the partial segment's block size: for b = 1, 2, 4, ... max_block (capped
     at its length), cut it into blocks of b and keep its top floor(k / b)
     blocks by mean s'; R(b) = the s' they retain. The largest b with
     R(b) >= (1 - epsilon) R(1) wins: coarse blocks where they cost little,
     single tokens where the budget is tight;
  5. exactly ``budget`` entries per KV head: what rounding to blocks of b left
     goes as the best free whole blocks of the prefix, largest first
     (max_block, ..., 2, 1; at most need // b of each size): one entry at most
     is a lone token while such blocks are free.

Parameters:
  window         16                  observation window, always kept (measured: docs/methods.md)
  kernel         5                   pooling width of the token scores (SnapKV's)
  group          "mean"              reduction over the query heads of a KV head
  delimiter_ids  from the tokenizer  tokens whose text ends with . , ; : ! ? newline 。！？，；：、
  max_segment    64                  longer segments are split
  min_segment    4                   shorter pieces merge into the next segment
  gamma          1.0                 s' = s + gamma * mean of s over the segment
  epsilon        0.1                 a block size may lose this fraction of R(1)
  max_block      64                  largest block size tried (1, 2, 4, ...)

The paper states the three stages (semantic segments, segment-guided scores,
a budget-driven block-size search); everything else above is ours, each
choice with its reason in docs/methods.md: the punctuation rule from token
text, the segment caps, the form of s', whole segments by mean score, the
search over powers of two and the top-up with whole blocks. Everything is vectorised over (sequence,
KV head, segment) with static shapes; the budget may be a traced scalar, so
one program serves every layer.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.policies import delimiters
from kvjax.policies import selection
from kvjax.policies.base import Policy
from kvjax.policies.fields import DelimiterFields
from kvjax.policies.fields import WindowFields


class Plan(NamedTuple):
  """What SABlock decided for one layer (for tests and inspection)."""

  segments: jax.Array  # [B, T] int32 segment id (window and padding: ids past the last)
  scores: jax.Array  # [B, K, T] float32 segment-guided score s' (0 outside the prefix)
  allocation: jax.Array  # [B, K, T_seg] int32 entries per segment: whole ones their size, the partial one what was left
  block_size: jax.Array  # [B, K, T_seg] int32 whole segments: their size; the partial one: its search's choice; else 0
  keep: jax.Array  # [B, K, T] bool, exactly the budget per head (when the prompt has it)
  single: jax.Array  # [B, K] int32 entries kept one token at a time (the rest went as segments and blocks)


@dataclasses.dataclass(frozen=True)
class SABlock(DelimiterFields, WindowFields, Policy):
  """Semantic-aware eviction with an adaptive block size per segment."""

  name: ClassVar[str] = "sablock"
  chunked_prefill: ClassVar[bool] = False  # segments from the prompt text
  delimiter_chars: ClassVar[tuple[str, ...]] = delimiters.CLAUSE_END
  window: int = 16  # not SnapKV's 64: small budgets need room to choose (docs/methods.md)
  max_segment: int = 64  # longer segments are split
  min_segment: int = 4  # shorter pieces merge into the next segment
  gamma: float = 1.0  # weight of the segment mean in s' = s + gamma * mean_seg(s)
  epsilon: float = 0.1  # a block size may lose this fraction of R(1)
  max_block: int = 64  # largest block size tried (powers of two up to it)

  def __post_init__(self):
    super().__post_init__()
    self._check_int("max_segment", 1)
    self._check_int("min_segment", 1)
    self._check_int("max_block", 1)
    if self.min_segment > self.max_segment:
      raise ValueError(f"policy {self.name!r}: min_segment {self.min_segment} exceeds "
                       f"max_segment {self.max_segment}")
    self._check_number("gamma", 0)
    self._check_number("epsilon", 0, 1)

  def block_sizes(self) -> tuple[int, ...]:
    """Candidate block sizes: 1, 2, 4, ... up to max_block."""
    sizes, b = [], 1
    while b <= self.max_block:
      sizes.append(b)
      b *= 2
    return tuple(sizes)

  def segments(self, ex, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[B, T] segment ids of the compressible region (tokens before the window)."""
    cut = self.is_delimiter(tokens)
    return ex.impl("segment_ids")(
        cut, jnp.maximum(lengths - self.window, 0), max_segment=self.max_segment,
        min_segment=self.min_segment)

  def keep(self, ex, scores, prompt, budget, max_budget):
    return self.plan(ex, scores, prompt, budget, max_budget).keep

  def plan(self, ex, scores, prompt, budget, max_budget: int) -> Plan:
    """The whole decision from token scores [B, K, T] (``score``'s output)."""
    t = scores.shape[-1]
    prefix, window = selection.regions(prompt.lengths, t, self.window)
    seg = self.segments(ex, prompt.tokens, prompt.lengths)
    s = jnp.where(prefix[:, None] & jnp.isfinite(scores), scores, 0.0)
    seg_mean = selection.segment_mean(s, seg, prefix)
    guided = jnp.where(prefix[:, None], s + self.gamma * jnp.where(
        jnp.isfinite(seg_mean), seg_mean, 0.0), 0.0)  # s' [B, K, T]
    size = selection.per_segment_sum(prefix.astype(jnp.float32), seg).astype(jnp.int32)  # [B, T_seg]
    room = budget - window.sum(-1)[:, None]  # [B, 1], or [B, K] for per-head budgets (AdaKV)

    # Whole segments by mean s' while they fit; the first that does not is the partial one.
    mean = jnp.where(size[:, None] > 0, selection.per_segment_sum(guided, seg) /
                     jnp.maximum(size, 1)[:, None], -jnp.inf)  # [B, K, T_seg]
    whole = selection.keep_whole(mean, size, room[..., None])
    used = jnp.where(whole, size[:, None], 0).sum(-1)  # [B, K]
    rest = jnp.where(whole, -jnp.inf, mean)
    partial = (jnp.arange(t) == jnp.argmax(rest, -1)[..., None]) & (rest > -jnp.inf)
    alloc = jnp.where(partial, (room - used)[..., None], 0)  # [B, K, T_seg]

    keeps, retained = self._search(guided, seg, prefix, size, alloc)
    sizes = jnp.asarray(self.block_sizes(), jnp.int32)
    # The largest block size that keeps (1 - epsilon) of what single tokens keep.
    good = retained >= (1.0 - self.epsilon) * retained[:1] - 1e-6  # [n_sizes, B, K, T_seg]
    choice = jnp.max(jnp.where(good, jnp.arange(len(sizes))[:, None, None, None], 0), axis=0)
    chosen_tok = selection.gather_segments(choice, seg)  # [B, K, T]
    blocks = jnp.any(keeps & (chosen_tok[None] == jnp.arange(len(sizes))[:, None, None, None]),
                     axis=0)
    chosen = (selection.gather_segments(whole, seg) | blocks) & prefix[:, None]
    # What rounding to whole blocks left: blocks of the remaining prefix, largest first.
    keep, single = self._top_up(chosen, guided, seg, prefix, room - chosen.sum(-1), max_budget)
    single += jnp.where(partial & (choice == 0), alloc, 0).sum(-1)
    block_size = jnp.where(whole, size[:, None], jnp.where(partial, sizes[choice], 0))
    return Plan(seg, guided, jnp.where(whole, size[:, None], alloc), block_size,
                keep | window[:, None], single)

  def _top_up(self, chosen, guided, seg, prefix, need, max_budget: int):
    """Spends ``need`` [B, K] more entries on whole blocks of the unkept prefix, largest first.

    For b = max_block, ..., 2, 1: the best ``need // b`` blocks of b tokens (the
    search's grid: b tokens from a segment's start, every one in the prefix
    and none kept yet) by their sum of s'. A remainder below the partial
    segment's block size thus goes as a few blocks, one token at most.

    Returns:
      (keep [B, K, T] bool, entries taken one token at a time [B, K] int32).
    """
    idx = jnp.arange(guided.shape[-1], dtype=jnp.int32)
    start = selection.segment_starts(seg)  # [B, T]
    single = jnp.zeros(need.shape, jnp.int32)
    for bs in reversed(self.block_sizes()):
      block = start + ((idx[None] - start) // bs) * bs  # [B, T] each token's block: its first token
      ids = jnp.broadcast_to(block[:, None], guided.shape)
      free = selection.per_segment_sum((prefix[:, None] & ~chosen).astype(jnp.float32), block)
      total = selection.per_segment_sum(guided, block)
      whole_free = ((idx[None] == block) & prefix)[:, None] & (free == bs)  # [B, K, T] at block starts
      take = selection.keep_top(jnp.where(whole_free, total, -jnp.inf), need[..., None] // bs,
                                max(1, max_budget // bs))
      chosen |= jnp.take_along_axis(take, ids, -1) & prefix[:, None]
      need -= take.sum(-1, dtype=jnp.int32) * bs
      if bs == 1:
        single = take.sum(-1, dtype=jnp.int32)
    return chosen, single

  def _search(self, guided, seg, prefix, size, alloc):
    """Keep masks [n_sizes, B, K, T] and retained s' [n_sizes, B, K, T_seg] per block size."""
    b, kh, t = guided.shape
    idx = jnp.arange(t, dtype=jnp.int32)
    start = selection.segment_starts(seg)  # [B, T]
    offset = idx[None] - start
    seg_size_tok = selection.gather_segments(size, seg)  # [B, T]
    alloc_tok = selection.gather_segments(alloc, seg)  # [B, K, T]
    keeps, retained = [], []
    for bs in self.block_sizes():
      block = start + (offset // bs) * bs  # [B, T] id of each token's block: its first token
      is_rep = (idx[None] == block) & prefix
      total = selection.per_segment_sum(jnp.where(prefix[:, None], guided, 0.0), block)
      count = selection.per_segment_sum(prefix.astype(jnp.float32), block)
      mean = total / jnp.maximum(count, 1.0)[:, None]  # [B, K, T] at block ids
      rank = _rank_in_segment(mean, is_rep, seg, stride=bs, span=self.max_segment)
      # Blocks never exceed their segment; a segment keeps floor(k_seg / b) of them.
      eff = jnp.minimum(bs, jnp.maximum(seg_size_tok, 1))[:, None]
      kept_block = is_rep[:, None] & (rank < alloc_tok // eff)
      keep = jnp.take_along_axis(kept_block, jnp.broadcast_to(block[:, None], guided.shape), -1)
      keep &= prefix[:, None]
      keeps.append(keep)
      retained.append(selection.per_segment_sum(jnp.where(keep, guided, 0.0), seg))
    return jnp.stack(keeps), jnp.stack(retained)


def _rank_in_segment(mean: jax.Array, is_rep: jax.Array, seg: jax.Array, *, stride: int,
                     span: int) -> jax.Array:
  """Rank of each block among its segment's blocks, best mean first (ties: earlier first).

  A segment's blocks start ``stride`` tokens apart and a segment spans at most
  ``span`` tokens (``max_segment``), so a block only meets the few block starts
  within ``span`` of it: counting the better ones there, shift by shift, gives
  the rank without sorting the prompt (a sort per block size was most of
  SABlock's cost on a CPU).

  Args:
    mean: [B, K, T] block means at block starts.
    is_rep: [B, T] bool, token starts a block of the compressible prefix.
    seg: [B, T] segment ids.

  Returns:
    [B, K, T] int32 rank, meaningful at block starts.
  """
  t = mean.shape[-1]
  idx = jnp.arange(t)

  def count_better(m, rank):
    d = m * stride
    later = (jnp.roll(seg, -d, -1) == seg) & jnp.roll(is_rep, -d, -1) & (idx + d < t)
    earlier = (jnp.roll(seg, d, -1) == seg) & jnp.roll(is_rep, d, -1) & (idx >= d)
    rank += (later[:, None] & (jnp.roll(mean, -d, -1) > mean)).astype(jnp.int32)
    return rank + (earlier[:, None] & (jnp.roll(mean, d, -1) >= mean)).astype(jnp.int32)

  return jax.lax.fori_loop(1, min(-(-span // stride), t), count_better,
                           jnp.zeros(mean.shape, jnp.int32))
