"""generate, generate_each and decode: a batch of prompts through prefill and decode.

A call checks its arguments and tokenizes its prompts (``inputs``), then per
(policy, budget) run: plans the run (``plan``), compiles its prefill and
decode programs before its cache exists (the compiler's transient memory then
does not stack on the page pool), prefills, appends any question, and decodes.

With a one-shot prefill and more than one run, the prompt's forward pass runs
once: no layer's prefill depends on what an earlier layer kept (each attends
over all of its prompt's keys), so every layer's q, k and v are recorded and
each run only stores what its policy keeps of them
(``kvjax.cache.store_prompt``) before decoding. That is the same computation
as a separate ``generate`` per run, at the cost of holding the recorded q, k,
v ([L, B, T, N + 2K, H]) while the runs go.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from kvjax import execution
from kvjax import policies as policies_lib
from kvjax.cache import attention as attention_lib
from kvjax.cache.paged import PagedKVCache
from kvjax.generation import calls
from kvjax.generation import inputs
from kvjax.generation import plan as plan_lib
from kvjax.generation import programs
from kvjax.generation import sampling
from kvjax.generation.compile import Clock
from kvjax.models.lm import LanguageModel
from kvjax.sharding import layout
from kvjax.sharding import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Measurements of one generate call (seconds exclude compilation)."""

  prompt_tokens: tuple[int, ...]  # valid prompt tokens per sequence
  generated_tokens: tuple[int, ...]  # tokens generated per sequence, stop token included
  prefill_s: float  # prefill (+ prompt compression) wall time, shared_prefill_s included
  decode_s: float  # decode loop wall time
  decode_steps: int  # forward passes in the decode loop
  compile_s: float  # time spent compiling in this call (0 when cached)
  kv_bytes: int  # bytes allocated for keys and values
  kv_capacity: tuple[tuple[int, ...], ...]  # slots per (layer, KV head)
  policy: str
  budget: int | None
  backend: str  # the backend paged decode attention ran on
  # Of prefill_s, the prompt forward that generate_each's runs share (the same
  # in each of them; 0 when nothing is shared): summing prefill_s over runs
  # counts it once per run, summing prefill_s - shared_prefill_s does not.
  shared_prefill_s: float = 0.0
  mesh_shape: tuple[int, int] = (1, 1)  # (data, model) shards the run was laid over

  @property
  def kv_bytes_per_device(self) -> int:
    """Bytes of keys and values each device holds (the pool is split evenly)."""
    return self.kv_bytes // (self.mesh_shape[0] * self.mesh_shape[1])

  @property
  def decode_tokens_per_s(self) -> float:
    """Generated tokens per second of decoding, summed over the batch."""
    return sum(self.generated_tokens) / self.decode_s if self.decode_s > 0 else float("nan")

  @property
  def decode_ms_per_step(self) -> float:
    return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  texts: list[str]  # decoded continuations (special tokens removed)
  token_ids: list[list[int]]  # generated ids per sequence, up to and including a stop id
  stats: GenerationStats
  cache: Any = None  # the final PagedKVCache (inspect with cache.kept_positions())


def generate(
    lm: LanguageModel,
    prompts: inputs.Prompts,
    *,
    policy: str | policies_lib.Policy = "full",
    budget: int | None = None,
    **kwargs,
) -> GenerationResult:
  """Generates continuations of a batch of prompts under a KV-cache policy.

  Args:
    lm: a model from ``kvjax.load``.
    prompts: one string, a list of strings, or a list of token-id lists (the
      context, when ``questions`` are given).
    policy: a policy name or object (``kvjax.policies.get``).
    budget: KV entries kept per (layer, KV head) after prefill, sinks and
      window included; None for "full".
    **kwargs: the options of ``generate_each`` (questions, query_aware,
      max_new_tokens, temperature, top_k, seed, chat_template, stop_ids,
      page_size, backend, pad_multiple, attention_block, prefill_chunk, mesh, decode_block).

  Returns:
    GenerationResult with texts, token ids, stats and the final cache.

  Raises:
    ValueError: a bad argument (see ``generate_each``), before any work is done.
  """
  return next(generate_each(lm, prompts, [(policy, budget)], **kwargs))


def generate_each(
    lm: LanguageModel,
    prompts: inputs.Prompts,
    runs: Sequence[tuple[str | policies_lib.Policy, int | None]],
    *,
    questions: inputs.Prompts | None = None,
    query_aware: bool = True,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    chat_template: bool = False,
    stop_ids: Sequence[int] | None = None,
    page_size: int = 16,
    backend: str = "auto",
    pad_multiple: int = 64,
    attention_block: int = attention_lib.PREFILL_BLOCK,
    prefill_chunk: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    decode_block: int | None = None,
) -> Iterator[GenerationResult]:
  """Generates for one batch of prompts under each (policy, budget) in turn.

  One-shot runs share the prompt's forward pass (the module docstring); each
  run's ``prefill_s`` counts it plus its own compression.

  Args:
    lm, prompts: as in ``generate``.
    runs: (policy name or object, budget) pairs; budget is None for "full".
    questions: optional text that follows each prompt. With ``query_aware``
      the prompt and question are compressed together (the question sits in
      the observation window); without it the prompt is compressed first and
      the question appended uncompressed (query-agnostic).
    max_new_tokens: tokens to generate per sequence (static: sets the output shape).
    temperature: 0 for greedy decoding, else sampling temperature.
    top_k: sample among the k most likely tokens (0 = all).
    seed: sampling seed.
    chat_template: each string prompt a user turn of the model's chat template; with
      ``questions`` one turn of both, cut where the question starts (query-agnostic
      runs compress the head and context, then append the rest uncompressed).
    stop_ids: ids that end a sequence (default: the tokenizer's stop ids).
    page_size: slots per cache page.
    backend: "auto", "xla", "pallas" or "native": the kernels of every op, "auto"
      per op (``kvjax.execution.create``).
    pad_multiple: prompts are right-padded to a multiple of this many tokens.
    attention_block: block size of the prefill's causal attention (its logits
      are [B, N, block, block] at a time).
    prefill_chunk: 0 for a one-shot prefill; else chunks of this many tokens,
      each attending to the compressed cache and itself, then compressed back
      to the budget: the pool holds the budget per head (+ question and
      decode tokens). For ``Policy.chunked_prefill`` policies; the chunk must
      hold the window. Each run prefills on its own.
    mesh: a (data, model) mesh (``kvjax.sharding.make_mesh``): sequences split
      over ``data``, KV heads (with their query heads and MLP columns) over
      ``model``, each device holding its part of the pool; the tokens of one
      device (docs/sharding.md). None: the default device.
    decode_block: decode steps per host round trip (None: 8 on a GPU, else 1).

  Yields:
    A GenerationResult per run, in the order of ``runs``.

  Raises:
    ValueError: a bad argument (unknown policy or backend, a budget the policy
      cannot honour or larger than the model's context, a prompt longer than
      the model's context, a non-positive size), before any work is done.
  """
  if stop_ids is None:
    stop_ids = lm.tokenizer.stop_ids if lm.tokenizer is not None else ()
  options = inputs.Options(
      max_new_tokens=max_new_tokens, page_size=page_size,
      pad_multiple=pad_multiple, attention_block=attention_block, prefill_chunk=prefill_chunk,
      stop_ids=tuple(stop_ids), temperature=temperature, top_k=top_k, seed=seed, mesh=mesh,
      decode_block=decode_block, ex=execution.create(backend))
  runs = inputs.check(lm, runs, options)
  batch = inputs.batch(lm, prompts, questions, query_aware=query_aware,
                       chat_template=chat_template, options=options)
  if mesh is not None:
    mesh_lib.check_mesh(mesh, lm.config, batch.size)
    lm = layout.shard_model(lm, mesh)
  yield from _runs(lm, batch, options, runs)


def _runs(lm: LanguageModel, batch: inputs.Batch, options: inputs.Options,
          runs: Sequence[inputs.Run]) -> Iterator[GenerationResult]:
  """``generate_each`` on checked runs and a tokenized batch."""
  shared, recorded = Clock(), None
  # Shared by the runs, or needed by a policy that selects from every layer at once.
  if (len(runs) > 1 or any(p.needs_every_layer for p, _ in runs)) and not options.prefill_chunk:
    recorded = calls.record(lm, batch, options, shared)
  for i, (policy, budget) in enumerate(runs):
    # Every run counts the shared forward's time; its compilation counts once.
    clock = Clock(shared.seconds, 0.0 if i else shared.compile_s)
    if recorded is not None:  # its first run scores for all (``Policy.shares_scores``)
      recorded = calls.share_scores(lm, batch, options, clock, recorded, policy)
    plan = plan_lib.plan_run(lm.config, batch, policy, budget, options, recorded is not None)
    result = _run(lm, batch, options, plan, clock, recorded)
    yield dataclasses.replace(result, stats=dataclasses.replace(
        result.stats, shared_prefill_s=shared.seconds.get("prefill", 0.0)))


def _run(lm: LanguageModel, batch: inputs.Batch, options: inputs.Options,
         plan: plan_lib.RunPlan, clock: Clock, recorded) -> GenerationResult:
  """Compiles, prefills and decodes one run."""
  # Compiled before the cache exists: the compiler's transient memory then
  # does not stack on the page pool and what the prefill leaves.
  abstract = jax.eval_shape(lambda: calls.new_cache(lm, batch, options, plan))
  logits = calls.compile_prefill(lm, batch, options, plan, clock, recorded, abstract)
  calls.run_decode(lm, batch, options, plan, clock, abstract, logits, compile_only=True)

  cache, logits = calls.run_prefill(lm, batch, options, plan, clock, recorded,
                                    calls.new_cache(lm, batch, options, plan))
  return finish_run(lm, batch, options, plan, clock, cache, logits)


def finish_run(lm: LanguageModel, batch: inputs.Batch, options: inputs.Options,
               plan: plan_lib.RunPlan, clock: Clock, cache: PagedKVCache,
               logits) -> GenerationResult:
  """A run from its filled cache on: appends the batch's questions, decodes, reports.

  ``generate`` calls it after the prefill; ``kvjax.answer`` on a saved
  compressed cache laid out as ``plan`` lays its cache out.

  Args:
    cache: the cache after prefill (donated).
    logits: [B, V] next-token logits after the prompt (unused when the batch
      has questions to append: the question's last token gives them).
  """
  if batch.question_tokens is not None:
    cache, logits = calls.append_questions(lm, batch, options, clock, cache)
  tokens, steps, cache = calls.run_decode(lm, batch, options, plan, clock, cache, logits)

  stops = {int(s) for s in options.stop_ids}
  token_ids = [_until_stop(row, stops) for row in np.asarray(tokens)]
  texts = [lm.tokenizer.decode(row) if lm.tokenizer is not None else "" for row in token_ids]
  stats = GenerationStats(
      prompt_tokens=tuple(int(n) for n in batch.next_positions),
      generated_tokens=tuple(len(row) for row in token_ids),
      prefill_s=clock.seconds.get("prefill", 0.0), decode_s=clock.seconds["decode"],
      decode_steps=int(steps) - 1, compile_s=clock.compile_s, kv_bytes=cache.kv_bytes,
      kv_capacity=cache.capacity, policy=plan.policy.name, budget=plan.budget,
      backend=options.ex.choice("paged_attention"), mesh_shape=cache.shards)
  return GenerationResult(texts, token_ids, stats, cache)


def decode(lm: LanguageModel, cache: PagedKVCache, logits, next_positions, *,
           policy: policies_lib.Policy, limit, max_new_tokens: int, backend: str = "xla",
           stop_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0,
           seed: int = 0, question=None):
  """Runs the compiled decode loop on a filled cache (what ``generate`` does after prefill).

  Benchmarks call it on caches they fill themselves (e.g. synthetic keys and
  values at lengths past the model's context): the step costs the same.

  Args:
    cache: a filled PagedKVCache (donated: do not reuse it).
    logits: [B, V] next-token logits after the prompt.
    next_positions: [B] int32 position of the first generated token.
    policy: a bound policy (decode-time eviction, accumulated attention).
    limit: [B, L, K] entries a head may hold (decode-evicting policies).
    backend: "auto", "xla", "pallas" or "native" (``kvjax.backend``), or a
      ``kvjax.execution.Execution``.
    question: [B, 2] positions [start, end) page eviction never takes (None: none).

  Returns:
    (tokens [B, max_new_tokens] int32 np.ndarray, steps run, final cache,
    seconds of the loop, seconds spent compiling).
  """
  clock = Clock()
  ex = backend if isinstance(backend, execution.Execution) else execution.create(backend)
  tokens, steps, cache = clock.run("decode", programs.decode, *calls.decode_call(
      lm, cache, logits, next_positions, policy=policy, limit=limit,
      question=np.zeros((len(next_positions), 2), np.int32) if question is None else question,
      max_new_tokens=max_new_tokens, ex=ex, stop_ids=stop_ids,
      sampler=sampling.from_options(temperature, top_k), seed=seed))
  return np.asarray(tokens), int(steps), cache, clock.seconds["decode"], clock.compile_s


def _until_stop(row: np.ndarray, stops: set[int]) -> list[int]:
  ids = []
  for t in row.tolist():
    ids.append(t)
    if t in stops:
      break
  return ids
