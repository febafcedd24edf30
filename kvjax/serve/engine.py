"""A serving engine: many requests over one page pool, where evicted pages admit more.

  engine = Engine(lm, policy="snapkv", budget=512, kv_memory="1GiB", max_slots=16)
  rid = engine.submit("Tell me a story.", max_tokens=64)
  for done in engine.run(): print(done.text)

The pool is sized by the user (``kv_memory`` bytes or ``num_pages``) and
shared by ``max_slots`` slots, not batch x capacity. A request waits in a
queue until a slot is free and the pool holds the pages it can ever need at
the engine's policy and budget (its prompt compressed to the budget, plus its
new tokens); those pages are set aside for it, so an admitted request never
runs out of memory. It is then prefilled into its slot (in chunks of
``prefill_chunk``, compressed after each, where the policy can; else at
once), and decodes with the running requests, ``steps_per_dispatch`` steps
per dispatch over every slot. A finished or cancelled request gives its
pages back at once. Every program is compiled once per shape: nothing
recompiles as requests come and go.

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
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import execution
from kvjax import policies as policies_lib
from kvjax.cache.paged import PagedKVCache, round_up
from kvjax.generation import inputs
from kvjax.models.lm import LanguageModel
from kvjax.serve import programs
from kvjax.serve.requests import Completion, Request, parse_bytes

MAX_STOP_IDS = 8  # a request's own stop ids, beside the tokenizer's


@dataclasses.dataclass
class _Running:
  """A request in a slot: what it has generated and the pages set aside for it."""

  request: Request
  pages: int
  tokens: list[int]


class Engine:
  """Requests in, completions out, over one shared page pool (the module docstring)."""

  def __init__(self, lm: LanguageModel, *, policy: str | policies_lib.Policy = "full",
               budget: int | None = None, kv_memory: str | int | None = None,
               num_pages: int | None = None, max_slots: int = 8, max_prompt_tokens: int = 4096,
               max_tokens: int = 256, prefill_chunk: int = 512, page_size: int = 16,
               steps_per_dispatch: int = 8, backend: str = "auto"):
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
      steps_per_dispatch: decode steps per dispatch (the host reads tokens between).
      backend: the kernels (``kvjax.execution.create``).

    Raises:
      ValueError: a bad argument, a policy the engine cannot serve, or a pool that
        cannot hold one request of the longest kind.
    """
    self.lm, self.ex = lm, execution.create(backend)
    chunk = prefill_chunk if policies_lib.get(policy).chunked_prefill else 0
    (self.policy, self.budget), = inputs.check(lm, [(policy, budget)], _options(
        max_tokens, page_size, chunk))
    for name, value in (("max_slots", max_slots), ("max_prompt_tokens", max_prompt_tokens),
                        ("steps_per_dispatch", steps_per_dispatch)):
      if not inputs._is_int(value) or value < 1:  # pylint: disable=protected-access
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    self.chunk = chunk
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
    self.num_pages = self._pool_pages(kv_memory, num_pages)
    self.cache = PagedKVCache.create(
        batch_size=max_slots, capacity=self.layout.capacity, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
        dtype=lm.dtype, windows=self.layout.windows if any(self.layout.windows) else None,
        num_pages=self.num_pages)
    self.stop_ids = tuple(lm.tokenizer.stop_ids) if lm.tokenizer is not None else ()
    self._slots = _SlotArrays(max_slots, self._limit(), len(self.stop_ids) + MAX_STOP_IDS)
    self._running: dict[int, _Running] = {}  # slot -> request
    self._queue: collections.deque[Request] = collections.deque()
    self._free_pages = self.num_pages
    self._ids = itertools.count()
    self.stats = collections.Counter()

  # ---------------------------------------------------------------- sizes

  def _layout(self, prompt_len: int, max_tokens: int):
    cfg = self.lm.config
    return self.policy.layout(self.budget, prompt_len=prompt_len, extra_tokens=0,
                              max_new_tokens=max_tokens, page_size=self.page_size,
                              num_kv_heads=cfg.num_kv_heads, windows=cfg.layer_windows)

  def pages_for(self, prompt_len: int, max_tokens: int) -> int:
    """Pages a request can ever hold: each head its capacity, or its tokens when fewer."""
    tokens = prompt_len + max_tokens
    heads = self.lm.config.num_kv_heads
    return sum(heads * -(-min(c, tokens) // self.page_size) for c in self.layout.capacity)

  def _pool_pages(self, kv_memory, num_pages) -> int:
    if (kv_memory is None) == (num_pages is None):
      raise ValueError("give the pool's size as one of kv_memory (bytes) or num_pages")
    cfg = self.lm.config
    page_bytes = 2 * self.page_size * cfg.head_dim * jnp.dtype(self.lm.dtype).itemsize
    pages = parse_bytes(kv_memory) // page_bytes if num_pages is None else num_pages
    need = self.pages_for(self.max_prompt, self.max_tokens)
    if not inputs._is_int(pages) or pages < need:  # pylint: disable=protected-access
      raise ValueError(f"a pool of {pages} pages cannot hold one request of the longest kind "
                       f"({need} pages: {self.max_prompt} prompt + {self.max_tokens} new "
                       f"tokens under {self.policy.name!r}); give it more memory")
    return int(pages)

  def _limit(self) -> np.ndarray:
    """[L, K] entries a head may hold while decoding (``Layout.decode_limits``)."""
    limits = np.asarray(self.layout.decode_limits)[:, None]
    return np.broadcast_to(limits, (len(limits), self.lm.config.num_kv_heads))

  # ---------------------------------------------------------------- requests

  def submit(self, prompt: str | Sequence[int], *, max_tokens: int | None = None,
             temperature: float = 0.0, seed: int = 0, stop: Sequence[str] = (),
             stop_ids: Sequence[int] = ()) -> int:
    """Queues a request (``max_tokens`` None: the engine's); returns its id.

    Raises:
      ValueError: an empty or too long prompt, or bad sampling values.
    """
    if len(stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} stop_ids, got {len(stop_ids)}")
    ids, = inputs._tokenize(self.lm, [prompt], "prompt")  # pylint: disable=protected-access
    request = Request.checked(next(self._ids), ids,
                              max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                              temperature=temperature, seed=seed, stop=tuple(stop),
                              stop_ids=tuple(stop_ids) + self.stop_ids,
                              max_prompt=self.max_prompt, max_new=self.max_tokens)
    self._queue.append(request)
    return request.id

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

  @property
  def waiting(self) -> int:
    return len(self._queue)

  @property
  def running(self) -> int:
    return len(self._running)

  @property
  def pages_in_use(self) -> int:
    """Pages the pool holds for the running requests (set aside, not yet all filled)."""
    return self.num_pages - self._free_pages

  # ---------------------------------------------------------------- the loop

  def run(self) -> Iterator[Completion]:
    """Steps until no request waits or runs, yielding each completion as it ends."""
    while self._queue or self._running:
      yield from self.step()

  def step(self) -> list[Completion]:
    """Admits what fits, then runs one decode dispatch; returns the requests that ended."""
    done = self._admit()
    if self._running:
      done += self._decode()
    return done

  def _admit(self) -> list[Completion]:
    done = []
    while self._queue and len(self._running) < self._slots.size:
      request = self._queue[0]
      pages = self.pages_for(len(request.ids), request.max_tokens)
      if pages > self._free_pages:
        break  # first come, first served: later requests wait behind it
      self._queue.popleft()
      slot = next(s for s in range(self._slots.size) if s not in self._running)
      self._free_pages -= pages
      self._running[slot] = _Running(request, pages, [])
      first = self._prefill(slot, request)
      self.stats["admitted"] += 1
      done += self._emit({slot: [first]}, ended=self._slots.start(slot, request, first))
    return done

  def _prefill(self, slot: int, request: Request) -> int:
    """Fills ``slot`` with the request's prompt; returns its first token."""
    ids, n = np.asarray(request.ids, np.int32), len(request.ids)
    statics = dict(graphdef=self.lm.graphdef, policy=self.policy, layout=self.layout,
                   ex=self.ex)
    if self.chunk:
      c = self.chunk
      logits = jnp.zeros((1, self.lm.config.vocab_size), jnp.float32)
      for start in range(0, n, c):
        tokens = np.zeros((1, c), np.int32)
        part = ids[start:start + c]
        tokens[0, :len(part)] = part
        self.cache, logits = programs.prefill_chunk(
            self.lm.params, self.cache, jnp.int32(slot), tokens, np.asarray([len(part)], np.int32),
            np.asarray([start], np.int32), logits, **statics)
    else:
      tokens = np.zeros((1, _bucket(n)), np.int32)
      tokens[0, :n] = ids
      self.cache, logits = programs.prefill(
          self.lm.params, self.cache, jnp.int32(slot), tokens, np.asarray([n], np.int32),
          block=512, **statics)
    first = programs.first_token(logits, jnp.asarray([request.temperature], jnp.float32),
                                 jnp.asarray([request.seed], jnp.uint32),
                                 jnp.asarray([n], jnp.int32))
    return int(first[0])

  def _decode(self) -> list[Completion]:
    self.cache, arrays, tokens = programs.decode(
        self.lm.params, self.cache, self._slots.arrays, graphdef=self.lm.graphdef,
        policy=self.policy, steps=self.steps, ex=self.ex)
    self._slots.arrays = arrays
    tokens = np.asarray(tokens)  # the one host sync of a dispatch
    active = np.asarray(arrays["active"])
    self.stats["dispatches"] += 1
    new = {slot: [int(t) for t in tokens[slot] if t >= 0] for slot in self._running}
    return self._emit(new, ended={s for s in self._running if not active[s]})

  def _emit(self, new: dict[int, list[int]], ended: set[int]) -> list[Completion]:
    """Appends new tokens; ends the requests that stopped (ids, strings) or ran out."""
    done, stop_now = [], set(ended)
    for slot, tokens in new.items():
      running = self._running[slot]
      running.tokens += tokens
      self.stats["tokens"] += len(tokens)
      text = self._text(running.tokens)
      if any(s in text for s in running.request.stop):
        stop_now.add(slot)
    for slot in sorted(stop_now):
      running = self._running[slot]
      done.append(Completion.of(running.request, running.tokens, self._text(running.tokens)))
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
    self.cache = programs.reset(self.cache, jnp.asarray(mask))
    for slot in slots:
      self._free_pages += self._running.pop(slot).pages
      self._slots.stop(slot)


class _SlotArrays:
  """The decode program's per-slot arrays (``programs.decode``), kept on the host side."""

  def __init__(self, size: int, limit: np.ndarray, num_stops: int):
    self.size, self.num_stops = size, num_stops
    self.limit = limit.astype(np.int32)
    self.arrays = {
        "last": np.zeros(size, np.int32), "positions": np.zeros(size, np.int32),
        "active": np.zeros(size, bool), "remaining": np.zeros(size, np.int32),
        "limit": np.broadcast_to(self.limit, (size,) + limit.shape).copy(),
        "temperature": np.zeros(size, np.float32), "seeds": np.zeros(size, np.uint32),
        "stops": np.full((size, num_stops), -1, np.int32)}

  def _set(self, slot: int, **values) -> None:
    arrays = {k: np.array(v) for k, v in self.arrays.items()}
    for name, value in values.items():
      arrays[name][slot] = value
    self.arrays = arrays

  def start(self, slot: int, request: Request, first: int) -> set[int]:
    """Sets the slot running from its first token; returns {slot} if that token ends it."""
    stops = np.full(self.num_stops, -1, np.int32)
    ids = request.stop_ids[:self.num_stops]
    stops[:len(ids)] = ids
    ended = first in request.stop_ids or request.max_tokens == 1
    self._set(slot, last=first, positions=len(request.ids), active=not ended,
              remaining=request.max_tokens - 1, temperature=request.temperature,
              seeds=request.seed, stops=stops)
    return {slot} if ended else set()

  def stop(self, slot: int) -> None:
    self._set(slot, active=False, remaining=0)


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
