"""A run's cache layout: how many slots each (layer, KV head) holds and how pages are shared.

One answer, from ``Policy.layout``, that generation, the bench and saved
caches size their cache by. A model's layers are global (window 0: the
policy's budget sizes them) or sliding-window rings (window W > 0: a ring of
its window, or of the run's tokens when fewer, that no policy evicts).

Dimension letters: L layers, K KV heads.
"""

from __future__ import annotations

import dataclasses

from kvjax.cache.paged import round_up

NO_LIMIT = 2 ** 31 - 1  # int32's largest: a head that never evicts


@dataclasses.dataclass(frozen=True)
class Layout:
  """The cache of one run (hashable: programs take it as a static)."""

  budget: int | None  # the run's budget per (layer, KV head); None for full
  budgets: tuple[int, ...]  # per model layer: entries kept after prefill (a ring: its size)
  capacity: tuple  # per model layer: slots per KV head (an int, or a tuple per head)
  pages: int | None  # the pool's pages per sequence (None: every head's capacity)
  windows: tuple[int, ...]  # per model layer: 0 global, W > 0 a ring of its window
  page_size: int
  grow: int  # entries each head takes after prefill (extra_tokens + max_new_tokens)

  @property
  def global_layers(self) -> tuple[int, ...]:
    """The layers the policy's budget sizes (window 0)."""
    return tuple(l for l, w in enumerate(self.windows) if not w)

  @property
  def per_head(self) -> bool:
    """Whether a layer's KV heads differ in size (a shared pool or per-head capacities)."""
    return self.pages is not None or any(not isinstance(c, int) for c in self.capacity)

  def is_ring(self, layer: int) -> bool:
    return self.windows[layer] > 0

  @property
  def selected(self) -> tuple[int, ...]:
    """Entries ``select`` keeps per layer: the budget; 0 on a ring, which keeps its
    window whatever select says (so a ring never widens select's static shapes)."""
    return tuple(0 if w else b for b, w in zip(self.budgets, self.windows))

  @property
  def decode_limits(self) -> tuple[int, ...]:
    """Entries a head of each layer may hold while decoding, beside an appended
    question: its budget; a ring's is unbounded (a ring evicts nothing)."""
    return tuple(NO_LIMIT if w else b for b, w in zip(self.budgets, self.windows))

  @property
  def max_budget(self) -> int:
    """The most entries a global layer keeps after prefill (select's static bound)."""
    return max(self.selected)


def num_global(windows: tuple[int, ...]) -> int:
  """The number of global layers. Raises ValueError for a model without one."""
  n = sum(1 for w in windows if not w)
  if not n:
    raise ValueError("the model has no global layer: a policy's budget has nothing to size")
  return n


def uniform(kept: tuple[int, ...], budget: int | None, *, growth: int, extra_tokens: int,
            page_size: int, **sizes) -> Layout:
  """Every head of global layer l holds ``kept[l]`` + the question + ``growth`` entries.

  ``kept``: per global layer; ``growth``: entries a head takes while decoding
  (the decode rule's). ``sizes``: ``Policy.layout``'s other arguments.
  """
  capacity = tuple(round_up(b + extra_tokens + growth, page_size) for b in kept)
  return with_rings(budget, kept, capacity, None, extra_tokens=extra_tokens,
                    page_size=page_size, **sizes)


def with_rings(budget: int | None, kept: tuple, capacity: tuple, pages: int | None, *,
               prompt_len: int, extra_tokens: int, max_new_tokens: int, page_size: int,
               num_kv_heads: int, windows: tuple[int, ...]) -> Layout:
  """The model's layout from its global layers' (kept, capacity, pool pages or None).

  A sliding-window layer is a ring of min(window, the run's tokens rounded to
  pages) slots per head; a shared pool (``pages``) also holds the rings' pages.

  Raises:
    ValueError: a window that is not a whole number of pages.
  """
  windows = tuple(windows)
  num_global(windows)
  grow = extra_tokens + max_new_tokens
  if all(not w for w in windows):
    return Layout(budget, tuple(kept), tuple(capacity), pages, windows, page_size, grow)
  window = max(windows)
  if window % page_size:
    raise ValueError(f"the model's sliding window of {window} tokens must be a multiple of "
                     f"page_size {page_size}: its layers' cache is a ring of whole pages")
  ring = min(window, round_up(prompt_len + grow, page_size))
  kept, capacity = iter(kept), iter(capacity)
  budgets = tuple(ring if w else next(kept) for w in windows)
  capacity = tuple(ring if w else next(capacity) for w in windows)
  if pages is not None:
    pages += sum(1 for w in windows if w) * num_kv_heads * ring // page_size
  return Layout(budget, budgets, capacity, pages, windows, page_size, grow)
