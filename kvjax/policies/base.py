"""What every eviction policy provides to generation.

A policy is a frozen dataclass (hashable, so jit treats it as static): its
fields are its hyper-parameters. It says how many entries each layer keeps for
a static budget, which prompt tokens to keep at prefill (a ``select`` function
handed to the cache's attention entry point) and what to do before each decode
step. Policies compose the shared stages of ``scoring`` (how important each
token is) and ``selection`` (which tokens a head keeps); ``fields`` holds the
hyper-parameters several policies share (the observation window, delimiter
tokens) as dataclass mixins.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache import attention as attention_lib
from kvjax.cache.paged import PagedKVCache, round_up
from kvjax.policies import selection

# Metadata of the fields generation fills in (``Policy.for_cache``): not set by
# users, not recorded among a row's settings.
SIZED = {"sized_by_generation": True}


def sized_field() -> dataclasses.Field:
  """A field ``for_cache`` sets (0: not sized yet)."""
  return dataclasses.field(default=0, metadata=SIZED)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base class. Subclasses set ``name`` and override what they change."""

  name: ClassVar[str] = ""
  # Evicts during decode so the cache never grows past its budget.
  evicts_during_decode: ClassVar[bool] = False
  # Keeps, per slot, the attention it received (cache.scores), updated each decode step.
  accumulates_attention: ClassVar[bool] = False
  # Its runs at several budgets over one recorded prompt can share its scores
  # (``select``'s layer_scores): ``score`` depends on neither budget, and it
  # keeps by the base class's ``select``. Worth it where scoring costs a pass
  # over the prompt (H2O).
  shares_scores: ClassVar[bool] = False
  # Can compress after each chunk of a chunked prefill: its scores come from an
  # observation window or from keys and values, not from the prompt's text or
  # from every prompt query.
  chunked_prefill: ClassVar[bool] = True

  def __post_init__(self):
    """Subclasses check their fields here (``_check_*``), so a bad value fails on creation."""

  def _check_int(self, field: str, minimum: int, odd: bool = False) -> None:
    """Raises ValueError unless the field is an int >= ``minimum`` (and odd if asked)."""
    value = getattr(self, field)
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
        or (odd and value % 2 == 0)):
      need = f"an{' odd' if odd else ''} int >= {minimum}"
      raise ValueError(f"policy {self.name!r}: {field} must be {need}, got {value!r}")

  def _check_number(self, field: str, low: float, high: float = math.inf) -> None:
    """Raises ValueError unless the field is a real number (not a bool) in [low, high)."""
    value = getattr(self, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
      bound = f">= {low}" if high == math.inf else f"in [{low}, {high})"
      raise ValueError(f"policy {self.name!r}: {field} must be a finite number {bound}, "
                       f"got {value!r}")

  def _check_choice(self, field: str, choices: tuple) -> None:
    """Raises ValueError unless the field is one of ``choices``."""
    value = getattr(self, field)
    if value not in choices:
      raise ValueError(f"policy {self.name!r}: {field} must be one of {choices}, got {value!r}")

  def _check_token_ids(self, field: str) -> None:
    """Makes a token-id field a tuple of ints >= 0, or raises ValueError.

    A tuple keeps the policy hashable: jit takes policies as static arguments.
    """
    ids = getattr(self, field)
    if (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
      raise ValueError(f"policy {self.name!r}: {field} must be a sequence of token ids "
                       f"(ints >= 0), got {ids!r}")
    object.__setattr__(self, field, tuple(ids))

  # Entries that are always kept and count against the budget (sinks + window).
  def reserved(self) -> int:
    return 0

  def bind(self, tokenizer) -> "Policy":
    """This policy with what it needs from the tokenizer filled in (default: itself)."""
    del tokenizer
    return self

  def validate(self, budget: int | None) -> None:
    """Raises ValueError for a budget this policy cannot honour."""
    if budget is None:
      raise ValueError(f"policy {self.name!r} needs a budget (KV entries per layer and KV head)")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
      raise ValueError(f"budget must be a positive int, got {budget!r}")
    if budget <= self.reserved():
      raise ValueError(
          f"budget {budget} must exceed the {self.reserved()} entries policy {self.name!r} "
          f"always keeps (sinks + observation window)")

  def check_chunk(self, chunk: int) -> None:
    """Raises ValueError unless this policy can compress a prefill in chunks of ``chunk``."""
    if not self.chunked_prefill:
      raise ValueError(f"policy {self.name!r} cannot compress a chunked prefill (it needs the "
                       "whole prompt's text or queries); use prefill_chunk=0")
    window = getattr(self, "window", 0)
    if chunk < window:
      raise ValueError(f"prefill_chunk {chunk} must hold policy {self.name!r}'s observation "
                       f"window of {window} tokens")

  def layer_budgets(self, budget: int, prompt_len: int, num_layers: int) -> tuple[int, ...]:
    """Entries each layer keeps after prefill (default: the budget everywhere)."""
    del prompt_len
    return (budget,) * num_layers

  def capacity(self, *, budget: int | None, prompt_len: int, extra_tokens: int,
               max_new_tokens: int, page_size: int, num_layers: int):
    """Slots per layer (a multiple of page_size).

    ``extra_tokens`` are appended after compression without being compressed
    (the question, in query-agnostic mode).
    """
    budgets = self.layer_budgets(budget, prompt_len, num_layers)
    grow = 0 if self.evicts_during_decode else max_new_tokens
    return tuple(round_up(b + extra_tokens + grow, page_size) for b in budgets)

  def for_cache(self, *, page_size: int, grow: int) -> "Policy":
    """This policy for a cache of ``page_size``-slot pages whose heads each take
    ``grow`` entries after prefill (the appended question and the new tokens).

    Default: itself. A policy whose heads share a layer's pages unevenly
    (AdaKV, Duo) gives each head whole pages, which takes both sizes.
    """
    del page_size, grow
    return self

  def cache_layout(self, num_kv_heads: int, **sizes) -> tuple[tuple[int, ...], int | None]:
    """(slots per KV head of each layer, the pool's pages per sequence) of a run's cache.

    ``sizes`` are ``capacity``'s arguments. The default gives every head its
    capacity and the pool every head's pages (None); a policy whose heads share
    a layer's budget (AdaKV) sizes both from the number of KV heads.
    """
    del num_kv_heads
    return self.capacity(**sizes), None

  @property
  def needs_every_layer(self) -> bool:
    """Its prefill needs every layer's q and k before any layer keeps (``select_recorded``)."""
    return False

  def select_recorded(self, budget: int | None, layer_budgets: tuple[int, ...], prompt,
                      recorded) -> attention_lib.SelectFn:
    """The keep rule when the prompt's forward was recorded first (default: ``select``).

    Args:
      prompt: the ``Prompt`` (tokens, positions, lengths).
      recorded: (q [L, B, T, N, H], k [L, B, T, K, H], v [L, B, T, K, H]).
    """
    del prompt, recorded
    return self.select(budget, layer_budgets)

  def select(self, budget: int | None, layer_budgets: tuple[int, ...],
             layer_scores: jax.Array | None = None) -> attention_lib.SelectFn:
    """The prefill keep rule: select(layer, prompt, q, k, v) -> (slots, slot scores | None).

    ``layer_budgets`` has one entry per layer, 0 on a sliding-window layer
    (a ring, which keeps its window whatever select keeps there).
    ``layer_scores``: [L, B, K, T] this policy's ``score`` of every layer,
    computed once for several budgets (``shares_scores``); None: scored here.
    """
    max_budget = max(layer_budgets)
    table = jnp.asarray(layer_budgets, jnp.int32)

    def select(layer, prompt, q, k, v):
      scores = self.score(prompt, q, k, v) if layer_scores is None else layer_scores[layer]
      keep = self.keep(scores, prompt, table[layer], max_budget)
      slots = selection.slots_from_keep(keep)
      return slots, (scores if self.accumulates_attention else None)

    return select

  def score(self, prompt: attention_lib.Prompt, q, k, v) -> jax.Array:
    """Token scores [B, K, T], higher = keep; -inf on padding."""
    raise NotImplementedError

  def keep(self, scores, prompt, budget, max_budget: int) -> jax.Array:
    """Keep mask [B, K, T] from scores (default: top ``budget`` per head)."""
    del prompt
    return selection.keep_top(scores, budget, max_budget)

  def evict_slot(self, cache: PagedKVCache, positions: jax.Array) -> jax.Array:
    """The slot each head gives up when full, [B, L, K] (decode-evicting policies)."""
    raise NotImplementedError

  def before_decode_step(self, cache: PagedKVCache, limit: jax.Array, positions: jax.Array,
                         question: jax.Array | None = None) -> PagedKVCache:
    """Runs before each decode step's append.

    Args:
      limit: [B, L, K] entries a head may hold (decode-evicting policies evict
        one token from each head at the limit, so the append keeps it there).
      positions: [B] position of the token about to be appended.
      question: [B, 2] positions [start, end) of the question, or None
        (page eviction never takes a page holding one of them).
    """
    del question
    if not self.evicts_during_decode:
      return cache
    full = cache.lengths >= limit
    return cache.remove(jnp.where(full, self.evict_slot(cache, positions), -1))


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """No eviction: every prompt and generated token stays in the cache."""

  name: ClassVar[str] = "full"

  def validate(self, budget):
    if budget is not None:
      raise ValueError(f"the full policy keeps every token; budget must be None, got {budget}")

  def layer_budgets(self, budget, prompt_len, num_layers):
    return (prompt_len,) * num_layers

  def select(self, budget, layer_budgets):
    del budget, layer_budgets

    def select(layer, prompt, q, k, v):
      return attention_lib.keep_all(layer, prompt, q, k, v), None

    return select
