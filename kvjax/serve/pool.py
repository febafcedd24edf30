"""The host's account of the engine's page pool: what a request can take, what is free.

The device takes pages off its free stack as heads grow and gives them back as
policies evict; it never refuses. So the engine admits a request, prefills a
chunk or runs a dispatch only when this account says the pages are there:
every bound below is an upper bound on what the device will take.

On a mesh the pool is cut into one block per device: a slot's pages lie in
the blocks of its data shard, its KV heads spread evenly over the model
shards. The account is then kept per data shard (a "block" here), each free
count being the model shards' least, times their number.
"""

from __future__ import annotations

import numpy as np

from kvjax.policies.layout import Layout


def most_pages(layout: Layout, num_kv_heads: int, page_size: int, tokens: int) -> int:
  """Pages a request of ``tokens`` (prompt and new) can ever hold: each head its capacity,
  or its tokens when fewer (a policy compresses each chunk back into the capacity)."""
  return sum(num_kv_heads * -(-min(c, tokens) // page_size) for c in layout.capacity)


class PageBook:
  """Sizes of requests in pages, and the pool's free pages per block, as last read."""

  def __init__(self, layout: Layout, *, num_kv_heads: int, page_size: int, steps: int,
               num_pages: int, blocks: tuple[int, int], slots: int):
    """``blocks``: (data, model) shards of the pool; ``slots``: S, split over data."""
    self.layout, self.heads, self.page_size = layout, num_kv_heads, page_size
    self.num_pages, (self.data, self.model) = num_pages, blocks
    self.slots_per_block = slots // self.data
    # Each head takes a page per page_size new tokens of a dispatch, rounded up.
    self.per_dispatch = len(layout.capacity) * num_kv_heads * -(-steps // page_size)
    self.free = np.full(self.data, num_pages // self.data)

  def most(self, prompt_len: int, max_tokens: int) -> int:
    """Pages a request can ever hold (``most_pages``)."""
    return most_pages(self.layout, self.heads, self.page_size, prompt_len + max_tokens)

  def growth(self, requests: list[tuple[int, int]]) -> int:
    """Pages decoding requests, each (most, held), may take in one dispatch."""
    if self.model > 1:  # held counts every model shard: a cap from it may be too low
      return len(requests) * self.per_dispatch
    return sum(min(self.per_dispatch, most - held) for most, held in requests)

  def block(self, slot: int) -> int:
    return slot // self.slots_per_block

  def read(self, num_free) -> None:
    """Takes the device's free counts: [] off a mesh, [data * model] on one."""
    free = np.asarray(num_free).reshape(self.data, self.model)
    self.free = free.min(axis=1) * self.model

  @property
  def in_use(self) -> int:
    return self.num_pages - int(self.free.sum())
