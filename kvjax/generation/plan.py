"""What one run of generate allocates, compiles and calls, fixed before it starts.

A run is one (policy, budget) over a batch. Its plan holds the budgets per
layer, the cache's capacity, the limit decode-time eviction holds each head
to, and its prefill: which program fills the cache, with which static
arguments, called on which chunks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies as policies_lib
from kvjax.cache.paged import PagedKVCache, round_up
from kvjax.generation import programs
from kvjax.generation import sampling
from kvjax.generation.compile import Clock
from kvjax.generation.inputs import Batch, Options
from kvjax.host_memory import to_device
from kvjax.models.lm import LanguageModel
from kvjax.sharding import layout


@dataclasses.dataclass(frozen=True)
class Recorded:
  """The prompt's one-shot forward pass, shared by the runs (``programs.record``)."""

  qkv: tuple[jax.Array, jax.Array, jax.Array]  # q [L, B, T, N, H], k, v [L, B, T, K, H]
  logits: jax.Array  # [B, V] at each sequence's last prompt token
  # Per policy that shares them (``Policy.shares_scores``): its scores [L, B, K, T].
  scores: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Prefill:
  """How a run fills its cache: ``program`` called once per start, in order.

  ``args(cache, start, logits)`` are the call's arguments; a chunk's call
  takes the logits so far and returns the cache and the new ones.
  """

  program: Callable
  statics: dict[str, Any]
  starts: tuple[int, ...]  # each call's first prompt token
  args: Callable[[Any, int, Any], tuple]
  logits: Any  # [B, V]: before the first call; for ``store``, the recorded ones it keeps
  returns_logits: bool = True  # False: the program returns the cache alone

  def compile(self, clock: Clock, cache) -> Any:
    """Compiles the program for ``cache`` (abstract); returns the logits [B, V] it will leave.

    Those are abstract (their shape and dtype), or for ``store`` the recorded ones.
    """
    program = clock.compile(self.program, self.args(cache, self.starts[0], self.logits),
                            self.statics)
    return program.out_info[1] if self.returns_logits else self.logits

  def run(self, clock: Clock, cache: PagedKVCache) -> tuple[PagedKVCache, jax.Array]:
    """Fills ``cache`` (donated); returns (cache, next-token logits [B, V])."""
    logits = self.logits
    for start in self.starts:
      out = clock.run("prefill", self.program, self.args(cache, start, logits), self.statics)
      cache, logits = out if self.returns_logits else (out, logits)
    return cache, logits


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One run's sizes and programs."""

  policy: policies_lib.Policy  # bound to the model's tokenizer
  budget: int | None  # entries per (layer, KV head) after prefill; None for "full"
  budgets: tuple[int, ...]  # the budget of each layer
  capacity: tuple[int, ...]  # the cache's slots per KV head, per layer
  limit: np.ndarray  # [B, L, K] int32 entries a head may hold while decoding
  prefill: Prefill
  new_cache: Callable[[], PagedKVCache]  # the run's empty cache


def plan_run(lm: LanguageModel, batch: Batch, policy: policies_lib.Policy, budget: int | None,
             options: Options, recorded: Recorded | None) -> RunPlan:
  """The plan of one run (``recorded``: the shared forward pass, if the runs share one)."""
  cfg = lm.config
  scores = None if recorded is None else recorded.scores.get(policy)
  policy = policy.for_cache(page_size=options.page_size,
                            grow=batch.question_len + options.max_new_tokens)
  budgets, capacity, pages = _layout(policy, cfg, batch, options, budget)
  per_head = pages is not None or any(not isinstance(c, int) for c in capacity)
  if per_head and options.mesh is not None:
    raise ValueError(f"policy {policy.name!r} gives its KV heads budgets of their own, which "
                     "a device mesh holding the heads apart cannot size; run it on one device")
  if options.prefill_chunk:  # never more than the whole prompt (the full policy keeps it all)
    whole = round_up(batch.prompt_len + batch.question_len + options.max_new_tokens,
                     options.page_size)
    capacity = tuple(min(c, whole) for c in capacity)
  # Decode-evicting policies hold each head at its budget (+ its question); ring
  # layers (sliding-window ones) evict nothing.
  ring = np.asarray(cfg.layer_windows)[None, :, None] > 0
  limit = np.broadcast_to(
      np.where(ring, np.iinfo(np.int32).max,
               np.asarray(budgets, np.int32)[None, :, None] + batch.question_lengths[:, None, None]),
      (batch.size, cfg.num_layers, cfg.num_kv_heads)).astype(np.int32)
  create = (PagedKVCache.create if options.mesh is None
            else functools.partial(layout.empty_cache, options.mesh))
  new_cache = functools.partial(
      create, batch_size=batch.size, capacity=capacity,
      num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      page_size=options.page_size, dtype=lm.dtype,
      windows=cfg.layer_windows if ring.any() else None,
      **({} if pages is None else dict(pages_per_sequence=pages)))
  statics = _statics(options, graphdef=lm.graphdef, policy=policy, budget=budget,
                     budgets=budgets, backend=options.backend)
  return RunPlan(policy, budget, budgets, capacity, limit,
                 _prefill(lm, batch, options, statics, recorded, scores), new_cache)


def _layout(policy: policies_lib.Policy, cfg, batch: Batch, options: Options,
            budget: int | None) -> tuple[tuple[int, ...], tuple, int | None]:
  """(budgets per layer, capacity per layer, the pool's pages per sequence or None).

  The policy sizes the global layers; a sliding-window layer is a ring of its
  window (``PagedKVCache``'s ``windows``), or of the run's tokens when fewer,
  and has no budget of its own: 0 in the budgets the policy's select sees
  (a ring keeps its window whatever select keeps there).
  """
  sizes = dict(budget=budget, prompt_len=batch.prompt_len, extra_tokens=batch.question_len,
               max_new_tokens=options.max_new_tokens, page_size=options.page_size)
  windows = cfg.layer_windows
  global_layers = cfg.global_layers
  if not global_layers:
    raise ValueError(f"{cfg.name} has no global layer: a policy's budget has nothing to size")
  budgets = policy.layer_budgets(budget, batch.prompt_len, len(global_layers))
  capacity, pages = policy.cache_layout(cfg.num_kv_heads, num_layers=len(global_layers), **sizes)
  if len(global_layers) == cfg.num_layers:
    return budgets, capacity, pages
  window = max(windows)
  if window % options.page_size:
    raise ValueError(f"{cfg.name}'s sliding window of {window} tokens must be a multiple of "
                     f"page_size {options.page_size}: its layers' cache is a ring of whole pages")
  ring = min(window, round_up(batch.prompt_len + batch.question_len + options.max_new_tokens,
                              options.page_size))
  budgets, capacity = iter(budgets), iter(capacity)
  layer_budgets = [0 if w else next(budgets) for w in windows]
  layer_capacity = [ring if w else next(capacity) for w in windows]
  if pages is not None:
    pages += (cfg.num_layers - len(global_layers)) * cfg.num_kv_heads * ring // options.page_size
  return tuple(layer_budgets), tuple(layer_capacity), pages


def _prefill(lm, batch: Batch, options: Options, statics: dict, recorded: Recorded | None,
             scores=None) -> Prefill:
  """A run's prefill: chunk by chunk, from a recorded forward pass (and the
  policy's shared ``scores``, if any), or one shot."""
  tokens, lengths = batch.tokens, batch.lengths
  if options.prefill_chunk:
    chunk = options.prefill_chunk

    def chunk_args(cache, start, logits):
      chunk_lengths = np.clip(lengths - start, 0, chunk).astype(np.int32)
      return (lm.params, cache, to_device(tokens[:, start:start + chunk]),
              to_device(chunk_lengths), to_device(np.full(lengths.shape, start, np.int32)),
              logits)

    # Each sequence's next-token logits come from the chunk holding its last token.
    no_logits = to_device(np.zeros((batch.size, lm.config.vocab_size), np.float32))
    return Prefill(programs.prefill_chunk, statics, tuple(range(0, batch.prompt_len, chunk)),
                   chunk_args, no_logits)
  if recorded is not None:
    return Prefill(programs.store, statics, (0,),
                   lambda cache, *_: (lm.params, cache, recorded.qkv, to_device(tokens),
                                      to_device(lengths)) + (() if scores is None else (scores,)),
                   recorded.logits, returns_logits=False)
  return Prefill(programs.prefill, dict(statics, block=options.attention_block), (0,),
                 lambda cache, *_: (lm.params, cache, to_device(tokens), to_device(lengths)),
                 None)


def _statics(options: Options, **statics) -> dict:
  """A program's static arguments, with the run's mesh (``compile.compiled``) when it has one."""
  return statics if options.mesh is None else dict(statics, mesh=options.mesh)


def record(lm: LanguageModel, batch: Batch, options: Options, clock: Clock) -> Recorded:
  """Runs the prompt's forward pass once, recording every layer's q, k and v."""
  cfg = lm.config
  shape = (cfg.num_layers, batch.size, batch.prompt_len)
  zeros = (jnp.zeros if options.mesh is None
           else lambda shape, dtype: layout.zeros(options.mesh, shape, dtype, "recorded"))
  buffers = tuple(zeros(shape + (heads, cfg.head_dim), lm.dtype)
                  for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
  args = (lm.params, buffers, to_device(batch.tokens), to_device(batch.lengths))
  statics = _statics(options, graphdef=lm.graphdef, block=options.attention_block,
                     backend=options.backend)
  return Recorded(*clock.run("prefill", programs.record, args, statics))


def share_scores(lm: LanguageModel, batch: Batch, options: Options, clock: Clock,
                 recorded: Recorded, policy: policies_lib.Policy) -> Recorded:
  """``recorded`` with ``policy``'s scores, computed (on ``clock``) by the first of
  its runs: a policy that ``shares_scores`` scores a recorded prompt once for
  all its budgets. Other policies, and runs on a mesh, get ``recorded`` as it is."""
  if not policy.shares_scores or options.mesh is not None or policy in recorded.scores:
    return recorded
  cfg = lm.config
  buffer = jnp.zeros((cfg.num_layers, batch.size, cfg.num_kv_heads, batch.prompt_len),
                     jnp.float32)
  args = (lm.params, buffer, recorded.qkv, to_device(batch.tokens), to_device(batch.lengths))
  statics = dict(graphdef=lm.graphdef, policy=policy, backend=options.backend)
  scores = clock.run("prefill", programs.score, args, statics)
  return dataclasses.replace(recorded, scores={**recorded.scores, policy: scores})


def append_questions(lm: LanguageModel, batch: Batch, options: Options, clock: Clock,
                     cache: PagedKVCache) -> tuple[PagedKVCache, jax.Array]:
  """Appends the questions to the cache uncompressed; returns (cache, logits [B, V])."""
  args = (lm.params, cache, to_device(batch.question_tokens), to_device(batch.question_lengths),
          to_device(batch.lengths))
  statics = _statics(options, graphdef=lm.graphdef, backend=options.backend)
  return clock.run("prefill", programs.extend, args, statics)


def decode_call(lm: LanguageModel, cache, logits, next_positions, *,
                policy: policies_lib.Policy, limit, question, max_new_tokens: int,
                backend: str, stop_ids, sampler: sampling.Sampler, seed: int,
                mesh=None) -> tuple[tuple, dict]:
  """(arguments, statics) of ``programs.decode``; cache and logits may be abstract."""
  pad_id = lm.tokenizer.pad_id if lm.tokenizer is not None else 0
  args = (lm.params, cache, logits, to_device(next_positions, np.int32),
          to_device(limit, np.int32), to_device(question, np.int32), to_device(seed, np.uint32),
          to_device(list(stop_ids) or [-1], np.int32), sampler, to_device(pad_id, np.int32))
  statics = dict(graphdef=lm.graphdef, policy=policy, max_new_tokens=max_new_tokens,
                 backend=backend)
  if mesh is not None:
    statics["mesh"] = mesh
  return args, statics
