"""A serving engine: many requests over one page pool, where evicted pages admit more.

  engine = Engine(lm, policy="snapkv", budget=512, kv_memory="1GiB", max_slots=16)
  rid = engine.submit("Tell me a story.", max_tokens=64)
  for done in engine.run(): print(done.text)

The pool is sized by the user (``kv_memory`` bytes or ``num_pages``) and
shared by ``max_slots`` slots, not batch x capacity. A request waits in a
queue until a slot is free and the pool has the pages its prompt can take
(each head at most its capacity under the engine's policy and budget) beside
what the running requests may grow by in one dispatch. It is prefilled into
its slot in chunks of ``prefill_chunk``, compressed after each where the
policy can (else at once), at most ``prefill_per_step`` prompt tokens between
two decode dispatches, so running requests keep generating while a long
prompt comes in. It then decodes with them, ``steps_per_dispatch`` steps per
dispatch over every slot. A finished or cancelled request gives its pages
back at once.

Never out of memory: before each dispatch the engine checks that the pool's
free pages cover what every running request can grow by in it; when they do
not (long generations under a cache that does not evict), the newest request
is preempted: its pages go back and it waits at the head of the queue, to be
computed again from its prompt (so its tokens are the same). A request alone
always fits: the engine refuses a pool that cannot hold one of the longest
kind. Every program is compiled once per shape: nothing recompiles as
requests come and go.

A request's greedy tokens are ``generate``'s on its prompt alone
(tests/test_serve.py), with one layout for all: the engine's, sized for its
longest prompt and generation. So PyramidKV keeps the pyramid of
``max_prompt_tokens`` (``generate`` sizes it by the prompt), and policies
whose heads have sizes of their own (AdaKV, Duo) are refused.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import execution
from kvjax import policies as policies_lib
from kvjax.cache.paged import PagedKVCache, round_up
from kvjax.generation import inputs
from kvjax.models.lm import LanguageModel
from kvjax.generation import compile as compile_lib
from kvjax.serve import programs
from kvjax.serve.pool import PageBook, most_pages
from kvjax.serve.requests import Completion, Request, parse_bytes
from kvjax.serve.slots import SlotArrays
from kvjax.sharding import layout as mesh_layout
from kvjax.sharding import mesh as mesh_lib

MAX_STOP_IDS = 8  # a request's own stop ids, beside the tokenizer's


@dataclasses.dataclass
class _Running:
  """A request in a slot: how much of its prompt is in, and what it has generated."""

  request: Request
  order: int  # when it was admitted: the newest is preempted first
  tokens: list[int] = dataclasses.field(default_factory=list)
  prefilled: int = 0  # prompt tokens in the cache
  logits: Any = None  # [1, V] the last prefilled chunk's (chunked prefill)

  @property
  def decoding(self) -> bool:
    return self.prefilled == len(self.request.ids)


class Engine:
  """Requests in, completions out, over one shared page pool (the module docstring)."""

  def __init__(self, lm: LanguageModel, *, policy: str | policies_lib.Policy = "full",
               budget: int | None = None, kv_memory: str | int | None = None,
               num_pages: int | None = None, max_slots: int = 8, max_prompt_tokens: int = 4096,
               max_tokens: int = 256, prefill_chunk: int = 512, prefill_per_step: int = 2048,
               page_size: int = 16, steps_per_dispatch: int = 8, backend: str = "auto",
               mesh: jax.sharding.Mesh | None = None):
    """
    Args:
      lm: the model (``kvjax.load``).
      policy, budget: the eviction policy every request runs under, and its budget
        (KV entries per layer and KV head; None for "full").
      kv_memory: the pool's size in bytes (an int, or "4GiB", "512MiB"); or
      num_pages: its size in pages. One of the two.
      max_slots: requests running at once (S).
      max_prompt_tokens, max_tokens: the longest prompt and generation a request may ask
        for (they size each slot's page table, not the pool).
      prefill_chunk: tokens per prefill chunk (policies that compress in chunks).
      prefill_per_step: prompt tokens prefilled between two decode dispatches (at least
        one chunk, or one whole prompt of a policy that prefills at once).
      steps_per_dispatch: decode steps per dispatch (the host reads tokens between).
      backend: the kernels (``kvjax.execution.create``).
      mesh: a (data, model) mesh (``kvjax.sharding.make_mesh``): slots split over data,
        each data shard's in its own part of the pool, KV heads over model.

    Raises:
      ValueError: a bad argument, a policy the engine cannot serve, a mesh that cannot
        split the model or slots, or a pool that cannot hold one request of the longest
        kind.
    """
    self.lm, self.ex, self.mesh = lm, execution.create(backend), mesh
    chunk = prefill_chunk if policies_lib.get(policy).chunked_prefill else 0
    (self.policy, self.budget), = inputs.check(lm, [(policy, budget)], _options(
        max_tokens, page_size, chunk))
    for name, value in (("max_slots", max_slots), ("max_prompt_tokens", max_prompt_tokens),
                        ("prefill_per_step", prefill_per_step),
                        ("steps_per_dispatch", steps_per_dispatch)):
      if not inputs._is_int(value) or value < 1:  # pylint: disable=protected-access
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    self.chunk, self.prefill_per_step = chunk, prefill_per_step
    self.max_prompt = round_up(max_prompt_tokens, self.chunk or 64)
    self.max_tokens, self.page_size, self.steps = max_tokens, page_size, steps_per_dispatch
    self.layout = self._layout(self.max_prompt, max_tokens)
    if self.layout.per_head:
      raise ValueError(f"policy {self.policy.name!r} gives its KV heads sizes of their own "
                       "(AdaKV, Duo): the engine serves policies whose heads share one layout")
    cfg = lm.config
    if self.max_prompt + max_tokens > cfg.max_position_embeddings:
      raise ValueError(f"max_prompt_tokens + max_tokens exceed the model's context of "
                       f"{cfg.max_position_embeddings}")
    if mesh is not None:
      mesh_lib.check_mesh(mesh, cfg, max_slots)
      self.lm = mesh_layout.shard_model(lm, mesh)
    shards = mesh_lib.mesh_sizes(mesh)
    self.pages = PageBook(self.layout, num_kv_heads=cfg.num_kv_heads, page_size=page_size,
                          steps=steps_per_dispatch, num_pages=self._pool_pages(
                              kv_memory, num_pages, shards), blocks=shards, slots=max_slots)
    self.num_pages = self.pages.num_pages
    sizes = dict(batch_size=max_slots, capacity=self.layout.capacity, num_layers=cfg.num_layers,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
                 dtype=lm.dtype, windows=self.layout.windows if any(self.layout.windows) else None,
                 num_pages=self.num_pages)
    self.cache = (PagedKVCache.create(**sizes) if mesh is None
                  else mesh_layout.empty_cache(mesh, **sizes))
    self.stop_ids = tuple(lm.tokenizer.stop_ids) if lm.tokenizer is not None else ()
    self._slots = SlotArrays(max_slots, len(self.stop_ids) + MAX_STOP_IDS)
    self._limit = np.broadcast_to(self._head_limits(), (max_slots,) + self._head_limits().shape)
    self._running: dict[int, _Running] = {}  # slot -> request
    self._queue: collections.deque[Request] = collections.deque()
    self._ids, self._order = itertools.count(), itertools.count()
    self._held_of, self._held_pages = None, None  # ``_held``'s last reading, and of what
    self.stats = collections.Counter()

  # ---------------------------------------------------------------- sizes

  def _layout(self, prompt_len: int, max_tokens: int):
    cfg = self.lm.config
    return self.policy.layout(self.budget, prompt_len=prompt_len, extra_tokens=0,
                              max_new_tokens=max_tokens, page_size=self.page_size,
                              num_kv_heads=cfg.num_kv_heads, windows=cfg.layer_windows)

  def pages_for(self, prompt_len: int, max_tokens: int) -> int:
    """Pages a request can ever hold (``PageBook.most``)."""
    return self.pages.most(prompt_len, max_tokens)

  def _pool_pages(self, kv_memory, num_pages, shards: tuple[int, int]) -> int:
    """The pool's pages: whole blocks, one per device, each data shard's able to hold
    one request of the longest kind."""
    if (kv_memory is None) == (num_pages is None):
      raise ValueError("give the pool's size as one of kv_memory (bytes) or num_pages")
    cfg = self.lm.config
    page_bytes = 2 * self.page_size * cfg.head_dim * jnp.dtype(self.lm.dtype).itemsize
    pages = parse_bytes(kv_memory) // page_bytes if num_pages is None else num_pages
    if not inputs._is_int(pages):  # pylint: disable=protected-access
      raise ValueError(f"num_pages must be an int, got {pages!r}")
    devices = shards[0] * shards[1]
    pages -= pages % devices
    need = most_pages(self.layout, cfg.num_kv_heads, self.page_size,
                      self.max_prompt + self.max_tokens)
    if pages // shards[0] < need:
      per = f" per data shard ({shards[0]})" if shards[0] > 1 else ""
      raise ValueError(f"a pool of {pages} pages cannot hold one request of the longest kind"
                       f"{per} ({need} pages: {self.max_prompt} prompt + {self.max_tokens} "
                       f"new tokens under {self.policy.name!r}); give it more memory")
    return int(pages)

  def _head_limits(self) -> np.ndarray:
    """[L, K] entries a head may hold while decoding (``Layout.decode_limits``)."""
    limits = np.asarray(self.layout.decode_limits, np.int32)[:, None]
    return np.broadcast_to(limits, (len(limits), self.lm.config.num_kv_heads))

  # ---------------------------------------------------------------- requests

  def submit(self, prompt: str | Sequence[int] | None = None, *,
             messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, stop: Sequence[str] = (),
             stop_ids: Sequence[int] = (), ignore_eos: bool = False) -> int:
    """Queues a request; returns its id.

    Args:
      prompt: a string or token ids; or
      messages: chat turns ({"role", "content"}), rendered with the model's chat template.
      max_tokens: tokens to generate at most (None: the engine's ``max_tokens``).
      temperature, top_k, seed: sampling (temperature 0: greedy; top_k 0: every token).
      stop, stop_ids: strings and token ids that end the completion.
      ignore_eos: leave out the tokenizer's stop ids (a benchmark's fixed output lengths).

    Raises:
      ValueError: not one of prompt and messages, an empty or too long prompt, or bad
        sampling values.
    """
    if (prompt is None) == (messages is None):
      raise ValueError("give a request one of prompt and messages")
    if messages is not None:
      prompt = self._render(messages)
    if isinstance(stop, str):
      stop = (stop,)
    if len(stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} stop_ids, got {len(stop_ids)}")
    ids, = inputs._tokenize(self.lm, [prompt], "prompt")  # pylint: disable=protected-access
    request = Request.checked(next(self._ids), ids,
                              max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                              temperature=temperature, top_k=top_k, seed=seed, stop=tuple(stop),
                              stop_ids=tuple(stop_ids) + (() if ignore_eos else self.stop_ids),
                              max_prompt=self.max_prompt, max_new=self.max_tokens,
                              vocab=self.lm.config.vocab_size)
    self._queue.append(request)
    return request.id

  def _render(self, messages) -> str:
    """The chat template's prompt of ``messages`` (ValueError for malformed turns)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
      raise ValueError("messages must be a non-empty list of {'role', 'content'} turns")
    for i, turn in enumerate(messages):
      if (not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str)
          or not isinstance(turn.get("content"), str)):
        raise ValueError(f"message {i} must have a string 'role' and 'content'")
    return self.lm.require_tokenizer("chat messages").apply_chat_template(list(messages))

  def cancel(self, request_id: int) -> bool:
    """Drops a waiting or running request (its pages go back at once); False if unknown."""
    for request in self._queue:
      if request.id == request_id:
        self._queue.remove(request)
        return True
    for slot, running in self._running.items():
      if running.request.id == request_id:
        self._release([slot])
        return True
    return False

  def tokens_of(self, request_id: int) -> list[int] | None:
    """The tokens a request has generated so far: [] while it waits, None once it ended
    (or was never submitted). A preempted request starts again from []."""
    if any(r.id == request_id for r in self._queue):
      return []
    for running in self._running.values():
      if running.request.id == request_id:
        return list(running.tokens)
    return None

  @property
  def waiting(self) -> int:
    return len(self._queue)

  @property
  def running(self) -> int:
    return len(self._running)

  @property
  def has_work(self) -> bool:
    return bool(self._queue or self._running)

  @property
  def pages_in_use(self) -> int:
    """Pages of the pool the running requests hold (as last read)."""
    return self.pages.in_use

  # ---------------------------------------------------------------- the loop

  def run(self) -> Iterator[Completion]:
    """Steps until no request waits or runs, yielding each completion as it ends."""
    while self.has_work:
      yield from self.step()

  def step(self) -> list[Completion]:
    """Prefills up to ``prefill_per_step`` prompt tokens (admitting what fits), makes
    room, then runs one decode dispatch; returns the requests that ended."""
    done, spent = [], 0
    while spent < self.prefill_per_step or not self._decoding():
      slot = self._prefilling()
      if slot is None:
        slot = self._admit()
      if slot is None or not self._fits_next_chunk(slot):
        break
      spent += self._prefill_some(slot)
      self.pages.read(self.cache.num_free)
      if self._running[slot].decoding:
        done += self._start(slot)
    self._make_room()
    if self._decoding():
      done += self._decode()
    return done

  def _decoding(self, block: int | None = None) -> list[int]:
    return [s for s, r in self._running.items()
            if r.decoding and (block is None or self.pages.block(s) == block)]

  def _in_block(self, block: int) -> list[int]:
    return [s for s in self._running if self.pages.block(s) == block]

  def _prefilling(self) -> int | None:
    return next((s for s, r in self._running.items() if not r.decoding), None)

  def _growth(self, slots: list[int], held: np.ndarray) -> int:
    """Pages the requests in ``slots`` may take in one decode dispatch."""
    most = lambda s: self.pages_for(len(self._running[s].request.ids),
                                    self._running[s].request.max_tokens)
    return self.pages.growth([(most(s), int(held[s])) for s in slots])

  def _held(self) -> np.ndarray:
    """[S] the pages each slot holds: a host sync, once per state of the cache."""
    if self._held_of is not self.cache:
      self._held_of, self._held_pages = self.cache, np.asarray(programs.held_pages(self.cache))
    return self._held_pages

  def _admit(self) -> int | None:
    """Gives the first waiting request a free slot in the block with the most room, if
    the block is empty or has room for its prompt beside its requests' next dispatch;
    returns the slot."""
    if not self._queue or len(self._running) == self._slots.size:
      return None
    request, held = self._queue[0], self._held()
    need = self.pages_for(len(request.ids), 0) + self.pages.per_dispatch
    free = [s for s in range(self._slots.size) if s not in self._running]
    fits = [s for s in free if not self._in_block(self.pages.block(s))
            or need + self._growth(self._in_block(self.pages.block(s)), held)
            <= self.pages.free[self.pages.block(s)]]
    if not fits:
      return None  # first come, first served: later requests wait behind it
    slot = max(fits, key=lambda s: (self.pages.free[self.pages.block(s)], -s))
    self._queue.popleft()
    self._running[slot] = _Running(request, next(self._order))
    self.stats["admitted"] += 1
    return slot

  def _fits_next_chunk(self, slot: int) -> bool:
    """Whether the slot's block has room for its next prompt chunk beside its decoding
    requests' next dispatch (else the prompt waits a dispatch: they end and give back)."""
    block = self.pages.block(slot)
    if len(self._in_block(block)) == 1:
      return True  # alone, a request always fits
    running, held = self._running[slot], self._held()
    n = len(running.request.ids)
    after = self.pages_for(n if not self.chunk else min(n, running.prefilled + self.chunk), 0)
    return (after - held[slot] + self._growth(self._decoding(block), held)
            <= self.pages.free[block])

  def _make_room(self) -> None:
    """Preempts the newest requests of each block until its free pages cover the next
    dispatch: each goes back to the head of the queue, to be computed again."""
    for block in range(self.pages.data):
      while (len(self._in_block(block)) > 1 and self.pages.free[block]
             < self._growth(self._decoding(block), self._held())):
        slot = max(self._in_block(block), key=lambda s: self._running[s].order)
        self._queue.appendleft(self._running[slot].request)
        self._release([slot])
        self.stats["preemptions"] += 1

  def _run(self, fn, *args, **statics):
    """``fn``'s program, compiled once per shape (on the mesh, if any), on ``args``."""
    program, _ = compile_lib.compiled(fn, args, dict(statics, ex=self.ex), self.mesh,
                                      programs.MESH_KINDS[fn.__name__])
    return program(*args)

  def _prefill_some(self, slot: int) -> int:
    """Prefills the next chunk of the slot's prompt (all of it for a one-shot policy);
    returns the tokens it took."""
    running = self._running[slot]
    ids, start = np.asarray(running.request.ids, np.int32), running.prefilled
    statics = dict(graphdef=self.lm.graphdef, policy=self.policy, layout=self.layout)
    if running.logits is None:
      running.logits = np.zeros((1, self.lm.config.vocab_size), np.float32)
    if not self.chunk:
      tokens = np.zeros((1, _bucket(len(ids))), np.int32)
      tokens[0, :len(ids)] = ids
      self.cache, running.logits = self._run(
          programs.prefill, self.lm.params, self.cache, np.int32(slot), tokens,
          np.asarray([len(ids)], np.int32), running.logits, block=512, **statics)
    else:
      part = ids[start:start + self.chunk]
      tokens = np.zeros((1, self.chunk), np.int32)
      tokens[0, :len(part)] = part
      self.cache, running.logits = self._run(
          programs.prefill_chunk, self.lm.params, self.cache, np.int32(slot), tokens,
          np.asarray([len(part)], np.int32), np.asarray([start], np.int32), running.logits,
          **statics)
    running.prefilled = min(len(ids), start + (self.chunk or len(ids)))
    return running.prefilled - start

  def _start(self, slot: int) -> list[Completion]:
    """Draws a prefilled request's first token and sets its slot decoding."""
    running = self._running[slot]
    request, logits, running.logits = running.request, running.logits, None
    first = programs.first_token(
        logits, jnp.asarray([request.temperature], jnp.float32),
        jnp.asarray([request.top_k], jnp.int32), jnp.asarray([request.seed], jnp.uint32),
        jnp.asarray([len(request.ids)], jnp.int32))
    first = int(first[0])
    ended = self._slots.start(slot, request, first)
    return self._emit({slot: [first]}, ended={slot} if ended else set())

  def _decode(self) -> list[Completion]:
    self.cache, arrays, tokens = self._run(
        programs.decode, self.lm.params, self.cache, self._slots.arrays, self._limit,
        graphdef=self.lm.graphdef, policy=self.policy, steps=self.steps)
    self._slots.arrays = arrays
    tokens = np.asarray(tokens)  # the one host sync of a dispatch
    self.pages.read(self.cache.num_free)
    active = self._slots.active()
    self.stats["dispatches"] += 1
    decoding = self._decoding()
    new = {slot: [int(t) for t in tokens[slot] if t >= 0] for slot in decoding}
    return self._emit(new, ended={s for s in decoding if not active[s]})

  def _emit(self, new: dict[int, list[int]], ended: set[int]) -> list[Completion]:
    """Appends new tokens; ends the requests that stopped (ids, strings) or ran out."""
    done, stop_now = [], set(ended)
    for slot, tokens in new.items():
      running = self._running[slot]
      running.tokens += tokens
      self.stats["tokens"] += len(tokens)
      if running.request.stop and any(s in self._text(running.tokens)
                                      for s in running.request.stop):
        stop_now.add(slot)
    for slot in sorted(stop_now):
      running = self._running[slot]
      done.append(Completion.of(running.request, running.tokens, self._text(running.tokens)))
    self.stats["finished"] += len(done)
    self._release(sorted(stop_now))
    return done

  def _text(self, tokens: list[int]) -> str:
    return self.lm.tokenizer.decode(tokens) if self.lm.tokenizer is not None else ""

  def _release(self, slots: list[int]) -> None:
    """Ends the requests in ``slots``: their pages go back to the pool at once."""
    if not slots:
      return
    mask = np.zeros(self._slots.size, bool)
    mask[slots] = True
    self.cache = self._run(programs.reset, mask, self.cache)
    for slot in slots:
      del self._running[slot]
      self._slots.stop(slot)
    self.pages.read(self.cache.num_free)


def _options(max_tokens: int, page_size: int, prefill_chunk: int) -> inputs.Options:
  """The generate options ``inputs.check`` validates an engine's settings with."""
  return inputs.Options(max_new_tokens=max_tokens, page_size=page_size,
                        pad_multiple=64, attention_block=512, prefill_chunk=prefill_chunk,
                        stop_ids=(), temperature=0.0, top_k=0, seed=0)


def _bucket(n: int) -> int:
  """A one-shot prefill's padded length: a power of two x 64, so a few sizes compile."""
  size = 64
  while size < n:
    size *= 2
  return size
