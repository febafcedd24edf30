"""Batched generation over the paged cache: jitted prefill, then a while_loop decode.

Prompts are right-padded to a multiple of ``pad_multiple`` tokens, so prompts of
nearby lengths share one compiled program; each sequence keeps its own length,
positions and cache lengths. Compiled programs are kept per (static
configuration, shapes), and compile time is reported apart from run time.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import backend as backend_lib
from kvjax import buffer_memory
from kvjax import host_memory
from kvjax import policies as policies_lib
from kvjax.cache import attention as attention_lib
from kvjax.cache.paged import PagedKVCache, round_up
from kvjax.host_memory import to_device
from kvjax.models.lm import LanguageModel


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Measurements of one generate call (seconds exclude compilation)."""

  prompt_tokens: tuple[int, ...]  # valid prompt tokens per sequence
  generated_tokens: tuple[int, ...]  # tokens generated per sequence, stop token included
  prefill_s: float  # prefill (+ prompt compression) wall time
  decode_s: float  # decode loop wall time
  decode_steps: int  # forward passes in the decode loop
  compile_s: float  # time spent compiling in this call (0 when cached)
  kv_bytes: int  # bytes allocated for keys and values
  kv_capacity: tuple[tuple[int, ...], ...]  # slots per (layer, KV head)
  policy: str
  budget: int | None
  backend: str

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
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
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
      page_size, backend, pad_multiple, attention_block, prefill_chunk).

  Returns:
    GenerationResult with texts, token ids, stats and the final cache.

  Raises:
    ValueError: a bad argument (see ``generate_each``), before any work is done.
  """
  return next(generate_each(lm, prompts, [(policy, budget)], **kwargs))


def generate_each(
    lm: LanguageModel,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    runs: Sequence[tuple[str | policies_lib.Policy, int | None]],
    *,
    questions: str | Sequence[str] | Sequence[Sequence[int]] | None = None,
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
) -> Iterator[GenerationResult]:
  """Generates for one batch of prompts under each (policy, budget) in turn.

  With a one-shot prefill and more than one run, the prompt's forward pass
  runs once: no layer's prefill depends on what an earlier layer kept (each
  attends over all of its prompt's keys), so every layer's q, k and v are
  recorded and each run only stores what its policy keeps of them
  (``kvjax.cache.store_prompt``) before decoding. That is the same
  computation as a separate ``generate`` per run, at the cost of holding the
  recorded q, k, v ([L, B, T, N + 2K, H]) while the runs go; each run's
  ``prefill_s`` counts the shared forward plus its own compression.

  Args:
    lm: a model from ``kvjax.load``.
    prompts: one string, a list of strings, or a list of token-id lists (the
      context, when ``questions`` are given).
    runs: (policy name or object, budget) pairs; budget is None for "full".
    questions: optional text that follows each prompt. With ``query_aware``
      the prompt and question are compressed together (the question sits in
      the observation window); without it the prompt is compressed first and
      the question appended uncompressed (query-agnostic).
    max_new_tokens: tokens to generate per sequence (static: sets the output shape).
    temperature: 0 for greedy decoding, else sampling temperature.
    top_k: sample among the k most likely tokens (0 = all).
    seed: sampling seed.
    chat_template: wrap each string prompt as a user turn of the model's chat template.
    stop_ids: ids that end a sequence (default: the tokenizer's stop ids).
    page_size: slots per cache page.
    backend: "auto", "xla", "pallas" or "native" for the kernels: paged decode attention,
      and the policy's prefill scoring (window scores, key norms).
    pad_multiple: prompts are right-padded to a multiple of this many tokens.
    attention_block: block size of the prefill's causal attention (its logits
      are [B, N, block, block] at a time).
    prefill_chunk: 0 for a one-shot prefill; else the prompt is prefilled in
      chunks of this many tokens, each attending to the compressed cache and
      to itself, after which the cache is compressed back to the budget: the
      pool holds the budget per head (+ question and decode tokens), and a
      chunk's keys and values stay in the chunk program's scratch. For
      policies that score from an observation window or from keys and values
      (``Policy.chunked_prefill``); the chunk must hold the window. Each run
      prefills on its own (its chunks attend to its own compressed cache).

  Yields:
    A GenerationResult per run, in the order of ``runs``.

  Raises:
    ValueError: a bad argument (unknown policy or backend, a budget the policy
      cannot honour or larger than the model's context, a prompt longer than
      the model's context, a non-positive size), before any work is done.
  """
  runs = [(policies_lib.get(policy), budget) for policy, budget in runs]
  if not runs:
    raise ValueError("runs is empty: pass at least one (policy, budget) pair")
  backend = backend_lib.resolve(backend)
  cfg = lm.config
  for name, value in (("max_new_tokens", max_new_tokens), ("page_size", page_size),
                      ("pad_multiple", pad_multiple), ("attention_block", attention_block)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 0:
    raise ValueError(f"prefill_chunk must be a positive int (or 0 for one shot), "
                     f"got {prefill_chunk!r}")
  for policy, budget in runs:
    policy.validate(budget)
    if prefill_chunk:
      policy.check_chunk(prefill_chunk)
    if budget is not None and budget > cfg.max_position_embeddings:
      # No sequence can ever hold more entries than the model's context: such a
      # budget is a typo (or a token count mistaken for something else).
      raise ValueError(f"budget {budget} exceeds the model's context of "
                       f"{cfg.max_position_embeddings} tokens")
  runs = [(policy.bind(lm.tokenizer), budget) for policy, budget in runs]
  if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= cfg.vocab_size:
    raise ValueError(f"top_k must be an int in [0, {cfg.vocab_size}], got {top_k!r}")
  ids = _tokenize(lm, prompts, chat_template)
  question_ids = None
  if questions is not None:
    question_ids = _tokenize(lm, questions, False)
    if len(question_ids) != len(ids):
      raise ValueError(f"{len(ids)} prompts but {len(question_ids)} questions")
    if query_aware:
      ids, question_ids = [p + q for p, q in zip(ids, question_ids)], None
  q_lengths = np.array([len(x) for x in question_ids or [[]] * len(ids)], np.int32)
  lengths = np.array([len(x) for x in ids], np.int32)
  longest = int((lengths + q_lengths).max())
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(
        f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the "
        f"model's context of {cfg.max_position_embeddings}")
  tokens = _pad(ids, prefill_chunk or pad_multiple)
  t_pad = tokens.shape[1]
  q_tokens = _pad(question_ids, pad_multiple) if question_ids else None
  q_pad = 0 if q_tokens is None else q_tokens.shape[1]
  if stop_ids is None:
    stop_ids = lm.tokenizer.stop_ids if lm.tokenizer is not None else ()

  recorded, shared = None, _Clock(lm.graphdef)  # a one-shot forward shared by the runs
  if len(runs) > 1 and not prefill_chunk:
    shape = (cfg.num_layers, len(ids), t_pad)
    buffers = tuple(jnp.zeros(shape + (heads, cfg.head_dim), lm.dtype)
                    for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
    recorded = shared("prefill", _record, (lm.params, buffers, to_device(tokens),
                                           to_device(lengths)), block=attention_block,
                      backend=backend)

  for i, (policy, budget) in enumerate(runs):
    # Every run counts the shared forward's time; its compilation counts once.
    clock = _Clock(lm.graphdef, dict(shared.seconds), 0.0 if i else shared.compile_s)
    budgets = policy.layer_budgets(budget, t_pad, cfg.num_layers)
    capacity = policy.capacity(
        budget=budget, prompt_len=t_pad, extra_tokens=q_pad,
        max_new_tokens=max_new_tokens, page_size=page_size, num_layers=cfg.num_layers)
    if prefill_chunk:  # never more than the whole prompt (the full policy keeps it all)
      capacity = tuple(min(c, round_up(t_pad + q_pad + max_new_tokens, page_size))
                       for c in capacity)
    new_cache = functools.partial(
        PagedKVCache.create, batch_size=len(ids), capacity=capacity,
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        page_size=page_size, dtype=lm.dtype)
    # Decode-evicting policies hold each head at its budget (+ its question).
    limit = np.broadcast_to(
        np.asarray(budgets, np.int32)[None, :, None] + q_lengths[:, None, None],
        (len(ids), cfg.num_layers, cfg.num_kv_heads))
    statics = dict(policy=policy, budget=budget, budgets=budgets, backend=backend)
    if prefill_chunk:
      prefill = _prefill_chunk
      no_logits = to_device(np.zeros((len(ids), cfg.vocab_size), np.float32))

      def prefill_args(cache, start, logits=no_logits):
        chunk_lengths = np.clip(lengths - start, 0, prefill_chunk).astype(np.int32)
        return (lm.params, cache, to_device(tokens[:, start:start + prefill_chunk]),
                to_device(chunk_lengths), to_device(np.full(lengths.shape, start, np.int32)),
                logits)
    elif recorded is not None:
      prefill = _store
      prefill_args = lambda cache, _: (lm.params, cache, recorded[0], to_device(tokens),
                                       to_device(lengths))
    else:
      prefill, statics = _prefill, dict(statics, block=attention_block)
      prefill_args = lambda cache, _: (lm.params, cache, to_device(tokens),
                                       to_device(lengths))
    # The run's prefill and decode programs are compiled before its cache
    # exists: the compiler's transient memory (~200 MiB for SmolLM2's chunk
    # program) then does not stack on the page pool and what the prefill left.
    abstract = jax.eval_shape(new_cache)
    program, dt = _compiled(prefill, prefill_args(abstract, 0), dict(statics, graphdef=lm.graphdef))
    logits = recorded[1] if recorded is not None else program.out_info[1]
    clock.compile_s += dt + _compiled(_decode, *_decode_call(
        lm, abstract, logits, lengths, policy=policy, limit=limit,
        max_new_tokens=max_new_tokens, backend=backend, stop_ids=stop_ids,
        temperature=temperature, top_k=top_k, seed=seed))[1]
    cache = new_cache()
    if prefill_chunk:
      logits = no_logits
      for start in range(0, t_pad, prefill_chunk):
        # Each sequence's next-token logits come from the chunk holding its last token.
        cache, logits = clock("prefill", prefill, prefill_args(cache, start, logits), **statics)
    elif recorded is not None:
      cache = clock("prefill", prefill, prefill_args(cache, 0), **statics)
    else:
      cache, logits = clock("prefill", prefill, prefill_args(cache, 0), **statics)
    next_pos = lengths
    if q_tokens is not None:
      cache, logits = clock(
          "prefill", _extend,
          (lm.params, cache, to_device(q_tokens), to_device(q_lengths), to_device(lengths)),
          backend=backend)
      next_pos = lengths + q_lengths

    out, steps, cache, decode_s, dt = decode(
        lm, cache, logits, next_pos, policy=policy, limit=limit,
        max_new_tokens=max_new_tokens, backend=backend, stop_ids=stop_ids,
        temperature=temperature, top_k=top_k, seed=seed)
    token_ids = [_until_stop(row, set(int(s) for s in stop_ids)) for row in np.asarray(out)]
    texts = [lm.tokenizer.decode(row) if lm.tokenizer is not None else "" for row in token_ids]
    stats = GenerationStats(
        prompt_tokens=tuple(int(n) for n in lengths + q_lengths),
        generated_tokens=tuple(len(row) for row in token_ids),
        prefill_s=clock.seconds["prefill"], decode_s=decode_s, decode_steps=int(steps) - 1,
        compile_s=clock.compile_s + dt, kv_bytes=cache.kv_bytes, kv_capacity=cache.capacity,
        policy=policy.name, budget=budget, backend=backend)
    yield GenerationResult(texts, token_ids, stats, cache)


def decode(lm: LanguageModel, cache: PagedKVCache, logits, next_positions, *,
           policy: policies_lib.Policy, limit, max_new_tokens: int, backend: str = "xla",
           stop_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0,
           seed: int = 0):
  """Runs the compiled decode loop on a filled cache (what ``generate`` does after prefill).

  Benchmarks call it on caches they fill themselves (e.g. synthetic keys and
  values at lengths past the model's context): the step costs the same.

  Args:
    cache: a filled PagedKVCache (donated: do not reuse it).
    logits: [B, V] next-token logits after the prompt.
    next_positions: [B] int32 position of the first generated token.
    policy: a bound policy (decode-time eviction, accumulated attention).
    limit: [B, L, K] entries a head may hold (decode-evicting policies).
    backend: a concrete backend ("xla", "pallas" or "native").

  Returns:
    (tokens [B, max_new_tokens] int32 np.ndarray, steps run, final cache,
    seconds of the loop, seconds spent compiling).
  """
  args, statics = _decode_call(lm, cache, logits, next_positions, policy=policy, limit=limit,
                               max_new_tokens=max_new_tokens, backend=backend,
                               stop_ids=stop_ids, temperature=temperature, top_k=top_k,
                               seed=seed)
  program, compile_s = _compiled(_decode, args, statics)
  buffer_memory.observe(program, "decode")
  start = time.perf_counter()
  out, steps, cache = jax.block_until_ready(program(*args))
  return np.asarray(out), int(steps), cache, time.perf_counter() - start, compile_s


def _decode_call(lm, cache, logits, next_positions, *, policy, limit, max_new_tokens, backend,
                 stop_ids, temperature, top_k, seed):
  """(arguments, statics) of ``_decode``; cache and logits may be abstract (ShapeDtypeStruct)."""
  pad_id = lm.tokenizer.pad_id if lm.tokenizer is not None else 0
  args = (lm.params, cache, logits, to_device(next_positions, np.int32),
          to_device(limit, np.int32), to_device(seed, np.uint32),
          to_device(list(stop_ids) or [-1], np.int32), to_device(temperature, np.float32),
          to_device(pad_id, np.int32))
  return args, dict(graphdef=lm.graphdef, policy=policy, max_new_tokens=max_new_tokens,
                    top_k=top_k, backend=backend)


# ------------------------------------------------------------------ programs


def _prefill(params, cache, tokens, lengths, *, graphdef, policy, block, budget, budgets,
             backend):
  """Prompt forward pass that fills (and compresses) the cache; returns (cache, logits [B, V]).

  The policy's scoring kernels (window scores, norms) run on ``backend``.
  """
  with backend_lib.use(backend):
    return _prefill_body(params, cache, tokens, lengths, graphdef=graphdef, policy=policy,
                         block=block, budget=budget, budgets=budgets)


def _prefill_body(params, cache, tokens, lengths, *, graphdef, policy, block, budget, budgets):
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  select = policy.select(budget, budgets)

  def attend(cache, layer, q, k, v):
    return attention_lib.prefill_attention(
        cache, layer, q, k, v, positions, lengths, tokens=tokens, select=select, block=block)

  hidden, cache = model(tokens, positions, cache, attend)
  last = hidden[jnp.arange(tokens.shape[0]), lengths - 1]  # [B, D]
  return cache, model.logits(last)


def _record(params, buffers, tokens, lengths, *, graphdef, block, backend):
  """Prompt forward pass that records every layer's q, k, v (no cache, no policy).

  Args:
    buffers: (q [L, B, T, N, H], k [L, B, T, K, H], v [L, B, T, K, H]) to fill
      (donated: filled in place).

  Returns:
    (the filled buffers, logits [B, V] at each sequence's last token).
  """
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

  def attend(buffers, layer, q, k, v):
    out = attention_lib.causal_attention(q, k, v, block=block)
    return tuple(b.at[layer].set(x.astype(b.dtype)) for b, x in zip(buffers, (q, k, v))), out

  with backend_lib.use(backend):  # packed weights' products
    hidden, buffers = model(tokens, positions, buffers, attend)
    last = hidden[jnp.arange(tokens.shape[0]), lengths - 1]
    return buffers, model.logits(last)


def _store(params, cache, recorded, tokens, lengths, *, graphdef, policy, budget, budgets,
           backend):
  """Stores what the policy keeps of a recorded prompt (``_record``) in every layer.

  Takes (and ignores) params so that, like every program here, the cache is
  argument 1, the one ``_compiled`` donates.
  """
  del params, graphdef
  with backend_lib.use(backend):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    prompt = attention_lib.Prompt(tokens, positions, lengths)
    select = policy.select(budget, budgets)

    def layer_body(layer, cache):
      q, k, v = (x[layer] for x in recorded)
      return attention_lib.store_prompt(cache, layer, prompt, q, k, v, select)

    return jax.lax.fori_loop(0, recorded[0].shape[0], layer_body, cache)


def _prefill_chunk(params, cache, tokens, lengths, offsets, logits, *, graphdef, policy, budget,
                   budgets, backend):
  """One prompt chunk: attend to the cache and itself, then compress back to the budget.

  Args:
    logits: [B, V] each sequence's next-token logits so far (zeros before the first chunk).

  Returns (cache, logits [B, V]: at each sequence's last token in the chunk, or
  the given ones where the chunk has none of its tokens).
  """
  with backend_lib.use(backend):
    model = nnx.merge(graphdef, params)
    positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    select = policy.select(budget, budgets)

    def attend(cache, layer, q, k, v):
      return attention_lib.chunk_attention(cache, layer, q, k, v, positions, lengths,
                                           select=select)

    hidden, cache = model(tokens, positions, cache, attend)
    last = hidden[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]
    return cache, jnp.where((lengths > 0)[:, None], model.logits(last), logits)


def _extend(params, cache, tokens, lengths, offsets, *, graphdef, backend):
  """Appends a chunk (the question) to the cache uncompressed; returns (cache, logits [B, V])."""
  model = nnx.merge(graphdef, params)
  positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]

  def attend(cache, layer, q, k, v):
    return attention_lib.extend_attention(cache, layer, q, k, v, positions, lengths)

  with backend_lib.use(backend):  # packed weights' products
    hidden, cache = model(tokens, positions, cache, attend)
    last = hidden[jnp.arange(tokens.shape[0]), lengths - 1]
    return cache, model.logits(last)


def _decode(params, cache, first_logits, next_pos, limit, seed, stops, temperature, pad_id, *,
            graphdef, policy, max_new_tokens, top_k, backend):
  """Greedy or sampled decoding in one while_loop; returns (tokens [B, M], steps, cache).

  ``backend`` runs the paged attention and the policy's and packed weights' ops.
  """
  with backend_lib.use(backend):
    return _decode_body(params, cache, first_logits, next_pos, limit, jax.random.key(seed),
                        stops, temperature, pad_id, graphdef=graphdef, policy=policy,
                        max_new_tokens=max_new_tokens, top_k=top_k, backend=backend)


def _decode_body(params, cache, first_logits, next_pos, limit, rng, stops, temperature, pad_id,
                 *, graphdef, policy, max_new_tokens, top_k, backend):
  model = nnx.merge(graphdef, params)
  b = first_logits.shape[0]

  def sample(logits, key):
    return _sample(logits, key, temperature, top_k)

  rng, key = jax.random.split(rng)
  first = sample(first_logits, key)
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, stops)

  def cond(state):
    step, _, done, _, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    step, out, done, cache, rng = state
    prev = out[:, step - 1]
    positions = (next_pos + step - 1)[:, None]  # [B, 1]

    def attend(cache, layer, q, k, v):
      return attention_lib.decode_attention(cache, layer, q, k, v, positions,
                                            accumulate=policy.accumulates_attention)

    cache = policy.before_decode_step(cache, limit, positions[:, 0])
    cache = cache.reserve(cache.lengths + 1)
    hidden, cache = model(prev[:, None], positions, cache, attend)
    rng, key = jax.random.split(rng)
    token = jnp.where(done, pad_id, sample(model.logits(hidden[:, 0]), key))
    out = out.at[:, step].set(token)
    return step + 1, out, done | jnp.isin(token, stops), cache, rng

  step, out, _, cache, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, done, cache, rng))
  return out, step, cache


def _sample(logits, key, temperature, top_k: int):
  """logits [B, V] -> token ids [B]; greedy where temperature == 0."""

  def greedy():
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled():
    scaled = logits / jnp.maximum(temperature, 1e-6)
    if top_k:
      kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
      scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled).astype(jnp.int32)

  # One program serves both (temperature is traced); the branch not taken
  # costs nothing, where a select would draw V Gumbel variates every step.
  return jax.lax.cond(temperature > 0, sampled, greedy)


# ------------------------------------------------------------------ compilation

_PROGRAMS: dict = {}
# Programs compiled so far, per kind.
COMPILE_COUNT = {"prefill": 0, "prefill_chunk": 0, "record": 0, "store": 0, "extend": 0,
                 "decode": 0}


class _Clock:
  """Runs compiled programs, adding their run seconds per name and their compile seconds."""

  def __init__(self, graphdef, seconds: dict | None = None, compile_s: float = 0.0):
    self.graphdef = graphdef
    self.seconds = seconds or {}
    self.compile_s = compile_s

  def __call__(self, name: str, fn, args, **statics):
    program, dt = _compiled(fn, args, dict(statics, graphdef=self.graphdef))
    self.compile_s += dt
    buffer_memory.observe(program, fn.__name__.strip("_"))
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    # What the program's scratch took comes back: glibc kept it, in a heap per
    # thread that ran it, and a chunked prefill's resident set grew by ~80 MiB
    # over its first chunks (SmolLM2 at budget 1024). Timed with it: 1-2 ms a call.
    host_memory.return_freed_memory()
    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
    return out


# XLA:CPU options for generate's programs. The fusion emitters (the default)
# took ~180 MiB of compiler memory for SmolLM2's chunked-prefill program and
# ~100 MiB for its decode program, over what the process held; the classic
# emitters take ~30 MiB, and the programs run as fast (in-process A/B on a
# 2-core CPU, 8K prompt: decode 12.1 vs 12.2 ms/token compressed, 33.9 vs 33.4
# full; one-shot prefill 25.6 vs 24.1 s, chunked 19.3 vs 20.5 s best of 3).
_CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
# And per program: XLA's memory-optimized scheduler shrinks the scratch of the
# chunk and decode programs (SmolLM2, 8K prompt, budget 1024: chunk 26.0 -> 15.0
# MiB with snapkv, 19.8 -> 14.9 with paged_eviction; decode 2.1 -> 1.1), but
# grew the one-shot prefill's (174.9 -> 197.4 MiB), which keeps the default.
_LEAN_SCHEDULE = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
_CPU_PROGRAM_OPTIONS = {"_prefill_chunk": _LEAN_SCHEDULE, "_decode": _LEAN_SCHEDULE}


def _compile(lowered, name: str = ""):
  """``lowered.compile()``, on a CPU with the options above where XLA has them.

  ``name`` is the program's function name (``_CPU_PROGRAM_OPTIONS``).
  """
  if jax.default_backend() != "cpu":
    return lowered.compile()
  try:
    return lowered.compile(
        compiler_options={**_CPU_COMPILER_OPTIONS, **_CPU_PROGRAM_OPTIONS.get(name, {})})
  except jax.errors.JaxRuntimeError as e:  # an XLA without them
    if "No such compile option" not in str(e) and "not a valid enum value" not in str(e):
      raise
    return lowered.compile()


def _compiled(fn, args, statics: dict):
  """The compiled program of ``fn`` for these statics and argument shapes.

  Returns (callable, seconds spent compiling now). The cache argument is
  donated so XLA updates the page pool in place.
  """
  shapes = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), args)
  key = (fn.__name__, tuple(sorted(statics.items(), key=lambda kv: kv[0])),
         jax.tree.structure(args), tuple(jax.tree.leaves(shapes)))
  if key in _PROGRAMS:
    return _PROGRAMS[key], 0.0
  start = time.perf_counter()
  jitted = jax.jit(functools.partial(fn, **statics), donate_argnums=(1,))
  program = _compile(jitted.lower(*args), fn.__name__)
  gc.collect()  # tracing leaves cycles behind
  host_memory.return_freed_memory()  # what the compiler freed
  _PROGRAMS[key] = program
  COMPILE_COUNT[fn.__name__.strip("_")] += 1
  return program, time.perf_counter() - start


# ------------------------------------------------------------------ text


def _tokenize(lm: LanguageModel, prompts, chat_template: bool) -> list[list[int]]:
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("prompts is empty")
  ids = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if lm.tokenizer is None:
        raise ValueError("this model has no tokenizer; pass token ids instead of strings")
      if chat_template:
        p = lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
      row = lm.tokenizer.encode(p)
    else:
      row = [int(t) for t in p]
      if any(t < 0 or t >= lm.config.vocab_size for t in row):
        raise ValueError(f"prompt {i} has token ids outside [0, {lm.config.vocab_size})")
    if not row:
      raise ValueError(f"prompt {i} is empty")
    ids.append(row)
  return ids


def _pad(rows: list[list[int]], multiple: int) -> np.ndarray:
  """Right-pads token rows to one length, a multiple of ``multiple``: [B, T] int32."""
  tokens = np.zeros((len(rows), round_up(max(len(r) for r in rows), multiple)), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens


def _until_stop(row: np.ndarray, stops: set[int]) -> list[int]:
  ids = []
  for t in row.tolist():
    ids.append(t)
    if t in stops:
      break
  return ids
