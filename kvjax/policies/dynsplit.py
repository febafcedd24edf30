"""DynSplit-KV (arXiv 2602.03184): importance-aware dynamic splitting into blocks.

The prompt is ``compressible region | observation window``; the window is
always kept and its queries score the rest. Per layer:

  1. candidates: a block may end after any token whose decoded text contains
     punctuation, a newline or a code delimiter (``delimiter_ids``);
  2. boundaries: walking from s = 0, the block ends at the candidate e in
     [s + C - D, s + C + D] maximising
         mean density on [s, e) - alpha * mean density on [e, s + C + D)
     (density: the window's attention per token, averaged over the layer's
     heads and window queries), i.e. where attention density drops; at
     s + C when no candidate lies in the range (kernels/segmentation.py);
  3. uniform mapping: the variable-length blocks (C - D .. C + D tokens) are
     read as fixed tiles of C + D slots with a length per tile, so block
     scoring and selection run on regular [B, K, NB, C + D] shapes;
  4. selection: blocks by mean token score (SnapKV-style, per KV head), whole
     blocks while they fit the budget, then the best single tokens so each
     KV head keeps exactly the budget.

See docs/methods.md for what is from the paper and what is ours.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from kvjax import backend as backend_lib
from kvjax.policies import blocks
from kvjax.policies import selection
from kvjax.policies.baselines import SnapKV

# Candidate boundaries: clause/sentence punctuation, newline, code delimiters.
CANDIDATE_CHARS = blocks.CLAUSE_END + blocks.CODE_DELIMITERS + ("(", "[", "\"", "'", "-")


class Plan(NamedTuple):
  """What DynSplit-KV decided for one layer (for tests and inspection)."""

  starts: jax.Array  # [B, NB] int32 first token of each block (unused: the region's end)
  sizes: jax.Array  # [B, NB] int32 tokens per block (0 = unused)
  block_scores: jax.Array  # [B, K, NB] float32 mean token score (-inf for unused blocks)
  keep: jax.Array  # [B, K, T] bool, exactly the budget per head (when the prompt has it)


@dataclasses.dataclass(frozen=True)
class DynSplitKV(SnapKV):
  """Importance-aware dynamic blocks, mapped to fixed tiles, selected under the budget."""

  name: ClassVar[str] = "dynsplit_kv"
  chunked_prefill: ClassVar[bool] = False  # boundaries from the prompt text
  window: int = 16  # last prompt tokens whose queries score the rest; always kept
  kernel: int = 5  # average pooling of the token scores (SnapKV's)
  delimiter_ids: tuple[int, ...] = ()  # candidate-boundary tokens; from the tokenizer when empty
  chunk: int = 16  # C: the ideal block length
  delta: int = 4  # D: a block ends within [s + C - D, s + C + D]
  alpha: float = 1.0  # weight of the density after a candidate boundary

  def __post_init__(self):
    super().__post_init__()
    blocks.check_ids(self, "delimiter_ids")
    self._check_int("chunk", 1)
    self._check_int("delta", 0)
    if self.delta >= self.chunk:
      raise ValueError(f"policy {self.name!r}: delta {self.delta} must be below chunk "
                       f"{self.chunk}")
    a = self.alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < float("inf"):
      raise ValueError(f"policy {self.name!r}: alpha must be a finite number >= 0, got {a!r}")

  def bind(self, tokenizer):
    if self.delimiter_ids or tokenizer is None:
      return self
    return dataclasses.replace(
        self, delimiter_ids=blocks.delimiter_ids(tokenizer, CANDIDATE_CHARS, anywhere=True))

  def select(self, budget, layer_budgets):
    max_budget = max(layer_budgets)
    table = jnp.asarray(layer_budgets, jnp.int32)

    def select(layer, prompt, q, k, v):
      del v
      return selection.slots_from_keep(self.plan(prompt, q, k, table[layer], max_budget).keep), None

    return select

  def plan(self, prompt, q, k, budget, max_budget: int) -> Plan:
    """Scores, splits and selects for one layer (q [B, T, N, H], k [B, T, K, H])."""
    if not self.delimiter_ids or prompt.tokens is None:
      raise ValueError("dynsplit_kv needs delimiter_ids (pass a tokenizer) and the prompt tokens")
    scores, density = blocks.window_scores(q, k, prompt.lengths, window=self.window,
                                           kernel=self.kernel, group=self.group)
    return self.plan_from_scores(scores, density, prompt, budget, max_budget)

  def plan_from_scores(self, scores, density, prompt, budget, max_budget: int) -> Plan:
    """The split and the selection from token scores [B, K, T] and density [B, T]."""
    b, kh, t = scores.shape
    prefix, window = blocks.regions(prompt.lengths, t, self.window)
    candidate = blocks.is_delimiter(prompt.tokens, self.delimiter_ids) & prefix
    starts, sizes = backend_lib.get("dynamic_split")(
        jnp.where(prefix, density, 0.0), candidate, jnp.maximum(prompt.lengths - self.window, 0),
        chunk=self.chunk, delta=self.delta, alpha=float(self.alpha))
    nb = starts.shape[1]
    width = self.chunk + self.delta
    # Uniform mapping: block j is tile j of `width` slots, the first sizes[j] valid.
    tile = starts[:, :, None] + jnp.arange(width)  # [B, NB, W]
    tile_ok = jnp.arange(width) < sizes[:, :, None]
    flat = jnp.clip(tile, 0, t - 1).reshape(b, 1, nb * width)
    tile_scores = jnp.take_along_axis(scores, jnp.broadcast_to(flat, (b, kh, nb * width)), -1)
    tile_scores = jnp.where(tile_ok[:, None], tile_scores.reshape(b, kh, nb, width), 0.0)
    block_scores = tile_scores.sum(-1) / jnp.maximum(sizes, 1)[:, None]
    block_scores = jnp.where(sizes[:, None] > 0, block_scores, -jnp.inf)
    block_scores = jnp.where(jnp.isnan(block_scores), -jnp.inf, block_scores)
    # Whole blocks in order of score while they fit the room left by the window.
    order = jnp.argsort(-block_scores, axis=-1)
    sorted_sizes = jnp.take_along_axis(jnp.broadcast_to(sizes[:, None], order.shape), order, -1)
    usable = jnp.take_along_axis(block_scores, order, -1) > -jnp.inf
    room = (budget - window.sum(-1))[:, None, None]
    fits_sorted = usable & (jnp.cumsum(jnp.where(usable, sorted_sizes, 0), -1) <= room)
    fits = jnp.zeros(order.shape, bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], order].set(fits_sorted)
    # Back from tiles to tokens.
    kept_tile = (fits[..., None] & tile_ok[:, None]).reshape(b, kh, nb * width)
    target = jnp.where(tile_ok, tile, t).reshape(b, 1, nb * width)
    chosen = jnp.zeros((b, kh, t), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None],
        jnp.broadcast_to(target, kept_tile.shape)].max(kept_tile, mode="drop")
    chosen = (chosen & prefix[:, None]) | window[:, None]
    keep = blocks.fill_to_budget(chosen, jnp.where(window[:, None], jnp.inf, scores), prefix,
                                 budget, max_budget)
    return Plan(starts, sizes, block_scores, keep)
