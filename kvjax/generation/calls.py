"""How generate calls its programs: each program's arguments and statics, from a plan.

``kvjax.generation.programs`` holds the bodies; this module puts a run's
arrays (moved to the device) and static values (the model's graph, the
policy, the layout, the execution) in the order a program takes them, and
runs it on the run's ``Clock``. A mesh run gives ``Clock`` its mesh; the
statics are the same on one device or many.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies as policies_lib
from kvjax.cache.paged import PagedKVCache
from kvjax.generation import programs
from kvjax.generation import sampling
from kvjax.generation.compile import Clock
from kvjax.generation.inputs import Batch, Options
from kvjax.generation.plan import CHUNKED, STORED, RunPlan
from kvjax.host_memory import to_device
from kvjax.models.lm import LanguageModel
from kvjax.sharding import layout as mesh_layout


@dataclasses.dataclass(frozen=True)
class Recorded:
  """The prompt's one-shot forward pass, shared by the runs (``record``)."""

  qkv: tuple[jax.Array, jax.Array, jax.Array]  # q [L, B, T, N, H], k, v [L, B, T, K, H]
  logits: jax.Array  # [B, V] at each sequence's last prompt token
  # Per policy that shares them (``Policy.shares_scores``): its scores [L, B, K, T].
  scores: dict = dataclasses.field(default_factory=dict)


def new_cache(lm: LanguageModel, batch: Batch, options: Options, plan: RunPlan) -> PagedKVCache:
  """The run's empty cache, laid out as its plan says (on the run's mesh, if any)."""
  cfg, layout = lm.config, plan.layout
  create = (PagedKVCache.create if options.mesh is None
            else lambda **kw: mesh_layout.empty_cache(options.mesh, **kw))
  return create(batch_size=batch.size, capacity=layout.capacity, num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                page_size=options.page_size, dtype=lm.dtype,
                windows=layout.windows if any(layout.windows) else None,
                **({} if layout.pages is None else dict(pages_per_sequence=layout.pages)))


def _prefill_call(lm: LanguageModel, batch: Batch, options: Options, plan: RunPlan,
                  recorded: Recorded | None, cache, start: int, logits) -> tuple:
  """(program, arguments, statics) of the prefill call at prompt token ``start``."""
  statics = dict(graphdef=lm.graphdef, policy=plan.policy, layout=plan.layout, ex=options.ex)
  tokens, lengths = batch.tokens, batch.lengths
  if plan.prefill == CHUNKED:
    chunk = options.prefill_chunk
    chunk_lengths = np.clip(lengths - start, 0, chunk).astype(np.int32)
    return programs.prefill_chunk, (
        lm.params, cache, to_device(tokens[:, start:start + chunk]), to_device(chunk_lengths),
        to_device(np.full(lengths.shape, start, np.int32)), logits), statics
  if plan.prefill == STORED:
    scores = recorded.scores.get(plan.policy)
    return programs.store, (lm.params, cache, recorded.qkv, to_device(tokens),
                            to_device(lengths)) + (() if scores is None else (scores,)), statics
  return programs.prefill, (lm.params, cache, to_device(tokens), to_device(lengths)), dict(
      statics, block=options.attention_block)


def _first_logits(lm: LanguageModel, batch: Batch, plan: RunPlan, recorded: Recorded | None):
  """[B, V] the logits before the first prefill call: zeros before a chunked prefill's
  first chunk, the recorded ones for a store (which returns the cache alone)."""
  if plan.prefill == CHUNKED:
    return to_device(np.zeros((batch.size, lm.config.vocab_size), np.float32))
  return recorded.logits if plan.prefill == STORED else None


def compile_prefill(lm, batch: Batch, options: Options, plan: RunPlan, clock: Clock,
                    recorded: Recorded | None, cache) -> jax.Array:
  """Compiles the run's prefill for ``cache`` (abstract); returns the logits [B, V] it
  will leave (abstract, or for a store the recorded ones)."""
  logits = _first_logits(lm, batch, plan, recorded)
  fn, args, statics = _prefill_call(lm, batch, options, plan, recorded, cache, plan.starts[0],
                                    logits)
  program = clock.compile(fn, args, statics, mesh=options.mesh)
  return logits if plan.prefill == STORED else program.out_info[1]


def run_prefill(lm, batch: Batch, options: Options, plan: RunPlan, clock: Clock,
                recorded: Recorded | None, cache: PagedKVCache) -> tuple[PagedKVCache, jax.Array]:
  """Fills ``cache`` (donated) as the plan says; returns (cache, next-token logits [B, V])."""
  logits = _first_logits(lm, batch, plan, recorded)
  for start in plan.starts:
    fn, args, statics = _prefill_call(lm, batch, options, plan, recorded, cache, start, logits)
    out = clock.run("prefill", fn, args, statics, mesh=options.mesh)
    cache, logits = (out, logits) if plan.prefill == STORED else out
  return cache, logits


def record(lm: LanguageModel, batch: Batch, options: Options, clock: Clock) -> Recorded:
  """Runs the prompt's forward pass once, recording every layer's q, k and v."""
  cfg = lm.config
  shape = (cfg.num_layers, batch.size, batch.prompt_len)
  zeros = (jnp.zeros if options.mesh is None
           else lambda shape, dtype: mesh_layout.zeros(options.mesh, shape, dtype, "recorded"))
  buffers = tuple(zeros(shape + (heads, cfg.head_dim), lm.dtype)
                  for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
  args = (lm.params, buffers, to_device(batch.tokens), to_device(batch.lengths))
  statics = dict(graphdef=lm.graphdef, block=options.attention_block, ex=options.ex)
  return Recorded(*clock.run("prefill", programs.record, args, statics, mesh=options.mesh))


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
  statics = dict(graphdef=lm.graphdef, policy=policy, ex=options.ex)
  scores = clock.run("prefill", programs.score, args, statics)
  return dataclasses.replace(recorded, scores={**recorded.scores, policy: scores})


def append_questions(lm: LanguageModel, batch: Batch, options: Options, clock: Clock,
                     cache: PagedKVCache) -> tuple[PagedKVCache, jax.Array]:
  """Appends the questions to the cache uncompressed; returns (cache, logits [B, V])."""
  args = (lm.params, cache, to_device(batch.question_tokens), to_device(batch.question_lengths),
          to_device(batch.lengths))
  statics = dict(graphdef=lm.graphdef, ex=options.ex)
  return clock.run("prefill", programs.extend, args, statics, mesh=options.mesh)


def decode_call(lm: LanguageModel, cache, logits, next_positions, *,
                policy: policies_lib.Policy, limit, question, max_new_tokens: int,
                ex, stop_ids, sampler: sampling.Sampler, seed: int,
                decode_block: int | None = None) -> tuple[tuple, dict]:
  """(arguments, statics) of ``programs.decode``; cache and logits may be abstract.
  ``decode_block``: steps per host round trip (None: the platform's)."""
  # A tokenizer without a pad or EOS id (a folder without tokenizer_config.json) pads
  # with 0: padding only follows a stop id, and such a model's stop ids are the caller's.
  pad_id = lm.tokenizer.pad_id if lm.tokenizer is not None else None
  pad_id = 0 if pad_id is None else pad_id
  args = (lm.params, cache, logits, to_device(next_positions, np.int32),
          to_device(limit, np.int32), to_device(question, np.int32), to_device(seed, np.uint32),
          to_device(list(stop_ids) or [-1], np.int32), sampler, to_device(pad_id, np.int32))
  block = programs.decode_block(ex.platform, max_new_tokens, decode_block)
  statics = dict(graphdef=lm.graphdef, policy=policy, max_new_tokens=max_new_tokens,
                 block=block, ex=ex)
  return args, statics


def run_decode(lm: LanguageModel, batch: Batch, options: Options, plan: RunPlan, clock: Clock,
               cache, logits, *, compile_only: bool = False):
  """Runs (or, for an abstract cache, compiles) a run's decode loop.

  Returns (tokens [B, max_new_tokens], steps run, cache), or the compiled program.
  """
  args, statics = decode_call(
      lm, cache, logits, batch.next_positions, policy=plan.policy, limit=plan.limit,
      question=batch.question_span, max_new_tokens=options.max_new_tokens, ex=options.ex,
      stop_ids=options.stop_ids, sampler=sampling.from_options(options.temperature, options.top_k),
      seed=options.seed, decode_block=options.decode_block)
  if compile_only:
    return clock.compile(programs.decode, args, statics, mesh=options.mesh)
  return clock.run("decode", programs.decode, args, statics, mesh=options.mesh)
