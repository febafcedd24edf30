"""What one run of generate allocates and runs, fixed before it starts.

A run is one (policy, budget) over a batch. Its plan is data: the policy's
cache ``Layout`` (budgets, capacity and pages per layer), the limit
decode-time eviction holds each head to, and how the prefill fills the cache
(one shot, chunk by chunk, or stored from a recorded forward pass). Calling
the programs a plan names is ``kvjax.generation.calls``'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax import policies as policies_lib
from kvjax.cache.paged import round_up
from kvjax.generation.inputs import Batch, Options
from kvjax.models.config import LlamaConfig
from kvjax.policies.layout import NO_LIMIT, Layout

# How a run fills its cache.
ONE_SHOT = "prefill"  # the prompt's forward pass, compressing each layer as it goes
CHUNKED = "prefill_chunk"  # chunk by chunk, compressing after each
STORED = "store"  # from a recorded forward pass shared by the runs (``calls.record``)


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One run's sizes and the way its cache is filled."""

  policy: policies_lib.Policy  # bound to the model's tokenizer
  layout: Layout  # the cache: budgets, slots and pages per layer (``Policy.layout``)
  limit: np.ndarray  # [B, L, K] int32 entries a head may hold while decoding
  prefill: str  # ONE_SHOT, CHUNKED or STORED: the program that fills the cache
  starts: tuple[int, ...]  # each prefill call's first prompt token

  @property
  def budget(self) -> int | None:
    """Entries per (layer, KV head) after prefill; None for "full"."""
    return self.layout.budget


def plan_run(config: LlamaConfig, batch: Batch, policy: policies_lib.Policy,
             budget: int | None, options: Options, recorded: bool) -> RunPlan:
  """The plan of one run (``recorded``: the runs share a recorded forward pass).

  Raises:
    ValueError: a policy whose heads have budgets of their own on a device
      mesh, or a layout the model cannot take (``Policy.layout``).
  """
  if not config.global_layers:
    raise ValueError(f"{config.name} has no global layer: a policy's budget has nothing to size")
  layout = policy.layout(budget, prompt_len=batch.prompt_len, extra_tokens=batch.question_len,
                         max_new_tokens=options.max_new_tokens, page_size=options.page_size,
                         num_kv_heads=config.num_kv_heads, windows=config.layer_windows)
  if layout.per_head and options.mesh is not None:
    raise ValueError(f"policy {policy.name!r} gives its KV heads budgets of their own, which "
                     "a device mesh holding the heads apart cannot size; run it on one device")
  if options.prefill_chunk:  # never more than the whole prompt (the full policy keeps it all)
    whole = round_up(batch.prompt_len + batch.question_len + options.max_new_tokens,
                     options.page_size)
    layout = dataclasses.replace(layout, capacity=tuple(min(c, whole) for c in layout.capacity))
    prefill, starts = CHUNKED, tuple(range(0, batch.prompt_len, options.prefill_chunk))
  else:
    prefill, starts = (STORED if recorded else ONE_SHOT), (0,)
  return RunPlan(policy, layout, _limit(config, batch, layout), prefill, starts)


def _limit(config: LlamaConfig, batch: Batch, layout: Layout) -> np.ndarray:
  """[B, L, K] int32: decode-evicting policies hold each head at its layer's limit
  (``Layout.decode_limits``) + its question."""
  limit = (np.asarray(layout.decode_limits, np.int64)[None, :, None]
           + batch.question_lengths[:, None, None])
  return np.broadcast_to(np.minimum(limit, NO_LIMIT), (batch.size, config.num_layers,
                                                       config.num_kv_heads)).astype(np.int32)
