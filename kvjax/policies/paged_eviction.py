"""PagedEviction: Structured Block-wise KV Cache Pruning for Efficient Large Language Model
Inference (arXiv 2509.04377).

Token importance comes from key and value norms alone, so no attention score
is computed anywhere and the paged decode attention runs untouched:

  prefill  keep the first page and the last (partial) page of the prompt, then
           the tokens with the highest ||v|| / ||k|| up to the budget, laid into
           pages in their original order;
  decode   append; once a head holds more than its budget (plus its question
           in query-agnostic mode) and its tail page is full, evict the one
           whole page with the lowest summed score, never the first page, the
           tail page nor a page holding the question: a head holds between
           its budget and a page more (the prototype's rule). Evicting a page
           is a page-table edit (``PagedKVCache.drop_pages``): no key or value
           moves and the page returns to the free stack.

Parameters:
  page_size   16          slots per page; must equal generate's page_size (the prototype's)
  variant     "v_over_k"  token score: v_over_k, v, inv_k or k_plus_v (the prototype's variants)
  per_head    False       False: scores averaged over KV heads, one decision per layer
  candidates  0           decode: only the oldest n evictable pages compete (0 = all)
  window      0           last prompt tokens always kept besides the last page

The paper states block-wise eviction for a paged layout without attention
scores and "one block evicted once the recent block becomes full"; the score
||v|| / ||k|| is read from summaries; the decode trigger (append, then evict
past the budget with the tail page full) and the oldest-pages candidates
(``candidates=3``) are the authors' prototype's. Ours, each with its reason in
docs/methods.md: every middle page a candidate by default; question pages
kept; ``window``; ||k|| clamped at 1e-6.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.paged import EMPTY
from kvjax.policies import decode
from kvjax.policies import scoring
from kvjax.policies import selection
from kvjax.policies.base import Policy

NORM_VARIANTS = ("v_over_k", "v", "inv_k", "k_plus_v")


def norm_scores(k_norm: jax.Array, v_norm: jax.Array, variant: str) -> jax.Array:
  """Token importance from key and value L2 norms (any shape, float32).

  v_over_k: ||v|| / ||k|| (the paper's, as summaries read it); v: ||v||;
  inv_k: 1 / ||k||; k_plus_v: ||k|| + ||v|| (the authors' prototype variants).
  """
  k_norm = k_norm.astype(jnp.float32)
  v_norm = v_norm.astype(jnp.float32)
  # A zero key would score inf; clamp so one token cannot outrank every other by +inf.
  safe_k = jnp.maximum(k_norm, 1e-6)
  if variant == "v_over_k":
    return v_norm / safe_k
  if variant == "v":
    return v_norm
  if variant == "inv_k":
    return 1.0 / safe_k
  if variant == "k_plus_v":
    return k_norm + v_norm
  raise ValueError(f"norm score variant must be one of {NORM_VARIANTS}, got {variant!r}")


@dataclasses.dataclass(frozen=True)
class PagedEviction(Policy):
  """Norm-scored prefill selection and whole-page eviction while decoding."""

  name: ClassVar[str] = "paged_eviction"
  page_size: int = 16  # slots per page; must equal generate's page_size (paper: 16)
  variant: str = "v_over_k"  # token score: v_over_k, v, inv_k or k_plus_v
  per_head: bool = False  # False: scores averaged over KV heads, one decision per layer
  candidates: int = 0  # decode: only the oldest n evictable pages compete (0 = all)
  window: int = 0  # [ours] last prompt tokens always kept besides the last page

  def __post_init__(self):
    self._check_int("page_size", 1)
    self._check_int("candidates", 0)
    self._check_int("window", 0)
    self._check_choice("variant", NORM_VARIANTS)
    if not isinstance(self.per_head, bool):
      raise ValueError(f"policy {self.name!r}: per_head must be a bool, got {self.per_head!r}")

  def reserved(self):
    # The first page and up to a page (or the window) at the end. A budget above
    # this leaves at least one full page between them to evict while decoding.
    return self.page_size + max(self.page_size, self.window)

  @property
  def decode(self):
    return decode.EvictPage(self.evict_page, self.page_size)

  def layout(self, budget, *, page_size, **sizes):
    """The base layout: a head evicts once it holds more than b + extra_tokens with
    its tail page full, so it never holds more than round_up(b + extra_tokens + 1)
    entries: the budget and one page more when the budget fills whole pages."""
    self.decode.check(page_size)
    return super().layout(budget, page_size=page_size, **sizes)

  def _reduce_heads(self, ex, scores: jax.Array, axis: int) -> jax.Array:
    """One score for all KV heads of a layer (the prototype's) unless per_head."""
    if self.per_head:
      return scores
    return jnp.broadcast_to(ex.axes.heads_mean(scores, axis, keepdims=True), scores.shape)

  def score(self, ex, prompt, q, k, v):
    """[B, K, T] norm score per token, e.g. ||v_t|| / ||k_t||; -inf on padding."""
    del q
    norm = ex.impl("token_norms")  # [B, T, K, H] -> [B, K, T]
    scores = self._reduce_heads(ex, norm_scores(norm(k), norm(v), self.variant), axis=1)
    return scoring.mask_padding(scores, prompt.lengths)

  def keep(self, ex, scores, prompt, budget, max_budget):
    """The first page, the last (partial) page and the window, then the best scores."""
    del ex
    t = scores.shape[-1]
    pos = jnp.arange(t)[None]
    length = prompt.lengths[:, None]
    valid = pos < length
    last_page = pos >= ((length - 1) // self.page_size) * self.page_size
    forced = valid & ((pos < self.page_size) | last_page | (pos >= length - self.window))
    chosen = jnp.broadcast_to(forced[:, None], scores.shape)
    return selection.fill_to_budget(chosen, jnp.where(chosen, jnp.inf, scores), valid, budget,
                                 max_budget)

  # ---------------------------------------------------------------- decode

  def page_scores(self, ex, cache) -> jax.Array:
    """[B, L, K, P_max] summed token score of each page a head owns (+inf for none).

    Computed from the pooled keys and values (norms only), so nothing needs
    storing at append time and the attention kernel is not involved.
    """
    table = cache.page_table
    ps = cache.page_size
    norm = ex.impl("token_norms")
    # The pool seen as one sequence of P * S_page tokens and one head.
    flat = lambda pages: norm(pages.reshape(1, -1, 1, pages.shape[-1])).reshape(-1, ps)
    pool = norm_scores(flat(cache.k_pages), flat(cache.v_pages), self.variant)  # [P, S_page]
    per_slot = jnp.where(selection.filled_slots(cache), selection.slot_view(cache, pool), 0.0)
    sums = per_slot.reshape(table.shape + (ps,)).sum(-1)  # [B, L, K, P_max]
    if not self.per_head:
      # Sum over the layer's heads (their pages hold the same positions).
      sums = jnp.broadcast_to(ex.axes.heads_sum(sums, 2, keepdims=True), sums.shape)
    return jnp.where(table >= 0, sums, jnp.inf)

  def evict_page(self, ex, cache, question: jax.Array | None = None) -> jax.Array:
    """[B, L, K] index of the page each head would give up (-1 when none may go).

    Candidates: pages 1 .. tail - 1 (never the first, never the tail page),
    none holding a position of ``question`` ([B, 2] [start, end)), and with
    ``candidates`` > 0 only the oldest ``candidates`` of those.
    """
    scores = self.page_scores(ex, cache)
    j = jnp.arange(scores.shape[-1])
    tail = (jnp.maximum(cache.lengths, 1) - 1) // cache.page_size  # [B, L, K]
    ok = (j >= 1) & (j < tail[..., None])
    if question is not None:
      ok &= ~_pages_holding(cache, question)
    if self.candidates:
      ok &= jnp.cumsum(ok, -1) <= self.candidates
    pick = jnp.argmin(jnp.where(ok, scores, jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(ok.any(-1), pick, EMPTY)


def _pages_holding(cache, span: jax.Array) -> jax.Array:
  """[B, L, K, P_max] bool: the head's page holds a position in [start, end) (span [B, 2])."""
  pos = selection.slot_view(cache, cache.positions)  # [B, L, K, S]
  inside = ((pos >= span[:, 0, None, None, None]) & (pos < span[:, 1, None, None, None])
            & selection.filled_slots(cache))
  return inside.reshape(cache.page_table.shape + (cache.page_size,)).any(-1)
