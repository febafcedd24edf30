"""What every eviction policy provides to generation: a layout, a scorer, a selector
and a decode rule.

A policy is a frozen dataclass (hashable, so jit treats it as static): its
fields are its hyper-parameters. Its four parts:

  layout(budget, **sizes)               how many slots each (layer, KV head) holds
                                        and how its heads share pages (``Layout``)
  score(ex, prompt, q, k, v)            the scorer: token scores [B, K, T], higher = keep
  keep(ex, scores, prompt, budget, m)   the selector: a keep mask [B, K, T] under the budget
  decode                                the decode rule (``decode.Keep``, ``EvictToken``, ...)

and two checks: ``reserved`` (entries always kept: the budget must exceed them)
and ``bind`` (what it needs from the tokenizer). Those six are what a policy
author overrides; ``select``, ``select_recorded`` and ``before_decode_step``
compose them for generation. Policies build on the shared stages of
``scoring`` and ``selection``; ``fields`` holds the hyper-parameters several
policies share (the observation window, delimiter tokens) as mixins.

Every method that traces takes ``ex`` (``kvjax.execution.Execution``): kernel
ops run as ``ex.impl(op)`` and reductions over KV heads as ``ex.axes.*``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache import attention as attention_lib
from kvjax.cache.paged import PagedKVCache
from kvjax.policies import decode as decode_lib
from kvjax.policies import layout as layout_lib
from kvjax.policies import selection
from kvjax.policies.layout import Layout


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base class. Subclasses set ``name`` and override what they change (of the six
  members the module docstring lists)."""

  name: ClassVar[str] = ""
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

  # ---------------------------------------------------------------- the six hooks

  def reserved(self) -> int:
    """Entries that are always kept and count against the budget (sinks + window)."""
    return 0

  def bind(self, tokenizer) -> "Policy":
    """This policy with what it needs from the tokenizer filled in (default: itself)."""
    del tokenizer
    return self

  def layout(self, budget: int | None, *, prompt_len: int, extra_tokens: int,
             max_new_tokens: int, page_size: int, num_kv_heads: int,
             windows: tuple[int, ...]) -> Layout:
    """The run's cache: every global layer keeps ``budget`` per KV head, then takes
    the question (``extra_tokens``, appended uncompressed) and what the decode
    rule lets it grow by; sliding-window layers (``windows`` > 0) are rings.

    Raises:
      ValueError: a model without global layers, or a window of part pages.
    """
    kept = (budget,) * layout_lib.num_global(windows)
    return layout_lib.uniform(kept, budget, growth=self.decode.growth(max_new_tokens),
                              prompt_len=prompt_len, extra_tokens=extra_tokens,
                              max_new_tokens=max_new_tokens, page_size=page_size,
                              num_kv_heads=num_kv_heads, windows=windows)

  def score(self, ex, prompt: attention_lib.Prompt, q, k, v) -> jax.Array:
    """Token scores [B, K, T], higher = keep; -inf on padding.

    q [B, T, N, H], k and v [B, T, K, H] as the layer computed them (RoPE applied).
    """
    raise NotImplementedError

  def keep(self, ex, scores, prompt, budget, max_budget: int) -> jax.Array:
    """Keep mask [B, K, T] from scores (default: top ``budget`` per head).

    ``budget``: a traced scalar (the layer's) or one per head [B, K];
    ``max_budget``: its static bound.
    """
    del ex, prompt
    return selection.keep_top(scores, budget, max_budget)

  @property
  def decode(self) -> decode_lib.Keep:
    """What happens before each decode step (default: nothing)."""
    return decode_lib.Keep()

  # ---------------------------------------------------------------- derived

  @property
  def evicts_during_decode(self) -> bool:
    """Evicts during decode, so the cache never grows past its budget."""
    return self.decode.evicts

  @property
  def needs_every_layer(self) -> bool:
    """Its prefill needs every layer's q and k before any layer keeps (``select_recorded``)."""
    return False

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

  def select(self, ex, layout: Layout,
             layer_scores: jax.Array | None = None) -> attention_lib.SelectFn:
    """The prefill keep rule: select(layer, prompt, q, k, v) -> (slots, slot scores | None).

    Scores each layer (``score``) and keeps under its budget (``keep``); a
    ring layer keeps its window whatever select keeps there.
    ``layer_scores``: [L, B, K, T] this policy's ``score`` of every layer,
    computed once for several budgets (``shares_scores``); None: scored here.
    """
    return keep_by(self, ex, layout, self.keep, layer_scores)

  def select_recorded(self, ex, layout: Layout, prompt, recorded) -> attention_lib.SelectFn:
    """The keep rule when the prompt's forward was recorded first (default: ``select``).

    Args:
      prompt: the ``Prompt`` (tokens, positions, lengths).
      recorded: (q [L, B, T, N, H], k [L, B, T, K, H], v [L, B, T, K, H]).
    """
    del prompt, recorded
    return self.select(ex, layout)

  def before_decode_step(self, ex, cache: PagedKVCache, limit: jax.Array, positions: jax.Array,
                         question: jax.Array | None = None) -> PagedKVCache:
    """Runs the decode rule before each decode step's append.

    Args:
      limit: [B, L, K] entries a head may hold (decode-evicting policies evict
        from each head at the limit, so the append keeps it there).
      positions: [B] position of the token about to be appended.
      question: [B, 2] positions [start, end) of the question, or None
        (page eviction never takes a page holding one of them).
    """
    return self.decode.before_step(ex, cache, limit, positions, question)


def keep_by(policy: Policy, ex, layout: Layout, keep, layer_scores=None) -> attention_lib.SelectFn:
  """The select function that scores with ``policy.score`` and keeps by
  ``keep(ex, scores, prompt, budget, max_budget)`` under the layout's budgets."""
  max_budget = layout.max_budget
  table = jnp.asarray(layout.selected, jnp.int32)

  def select(layer, prompt, q, k, v):
    scores = policy.score(ex, prompt, q, k, v) if layer_scores is None else layer_scores[layer]
    slots = selection.slots_from_keep(keep(ex, scores, prompt, table[layer], max_budget))
    return slots, (scores if policy.accumulates_attention else None)

  return select


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """No eviction: every prompt and generated token stays in the cache."""

  name: ClassVar[str] = "full"

  def validate(self, budget):
    if budget is not None:
      raise ValueError(f"the full policy keeps every token; budget must be None, got {budget}")

  def layout(self, budget, *, prompt_len, extra_tokens, max_new_tokens, page_size,
             num_kv_heads, windows):
    kept = (prompt_len,) * layout_lib.num_global(windows)
    return layout_lib.uniform(kept, budget, growth=max_new_tokens, prompt_len=prompt_len,
                              extra_tokens=extra_tokens, max_new_tokens=max_new_tokens,
                              page_size=page_size, num_kv_heads=num_kv_heads, windows=windows)

  def select(self, ex, layout, layer_scores=None):
    del layout, layer_scores

    def select(layer, prompt, q, k, v):
      return attention_lib.keep_all(layer, prompt, q, k, v), None

    return select
