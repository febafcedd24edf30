"""Property tests of PagedKVCache: random operation sequences against a plain-Python model.

Hypothesis draws a cache configuration (CONFIGS) and a program of up to MAX_OPS
operations on the batch:

  prefill   chosen empty sequences take prompts of random lengths, keeping every
            token, a random subset, or what a policy selects under its budget
            (through ``prefill_attention`` when the whole batch is chosen, else
            through set_lengths / reserve / write on the chosen rows);
  decode    one token for every sequence: reserve + append in each layer, or
            open_token_slots + write_token (drawn per step), after an optional
            decode-time eviction by streaming_llm or h2o;
  unreserved_append  an append without the reserve (its token is dropped where
            the head has no page for it);
  remove    a random slot per head, in range or not (random evictions; pages left
            empty are freed);
  reset     chosen sequences are emptied; their rows are reused by later prefills.

The same program drives ``Reference``, a plain-Python cache: per (sequence,
layer, KV head) a list indexed by slot of (position, key, value, score), and
the number of pages the head owns. After every operation ``check`` asserts:

  1. pages: none owned twice or both owned and free, free + owned = the pool,
     none lost; rows filled front to back; free pages, and owned slots at or
     past a head's length, hold no entry and score 0
     (kvjax.testing.assert_cache_consistent); each head owns the pages the
     reference says;
  2. lengths never exceed capacity and equal the reference's;
  3. content: every kept slot holds exactly the position, key, value and score
     the reference has for that slot (and kept_positions() agrees);
  4. policy promises after a policy's prefill, where the capacity holds the
     budget: kept counts equal min(budget, length) (chunkkv: at most the
     budget), sinks and the observation window are kept; a decode-time
     eviction never removes a sink (streaming_llm) or a recent token (h2o);
  5. attention and isolation: paged attention over the cache equals dense
     attention over the reference's entries, and filling every page that a
     sequence does not own with NaN leaves that sequence's output bit-identical.

Example budget: EXAMPLES (150) programs, derandomized so that CI runs the same
cases every time (about 1,000 checked states; well under a minute on 2 cores).
KVJAX_PROPERTY_EXAMPLES overrides it for longer local runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import EMPTY
from kvjax.cache import PagedKVCache
from kvjax.cache import Prompt
from kvjax.cache import attention
from kvjax.kernels.paged_attention import paged_attention_reference

EXAMPLES = int(os.environ.get("KVJAX_PROPERTY_EXAMPLES", "150"))
MAX_OPS = 12
SETTINGS = hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                               database=None, print_blob=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


@dataclasses.dataclass(frozen=True)
class Config:
  batch: int  # B
  layers: int  # L
  kv_heads: int  # K
  head_dim: int  # H
  page_size: int
  capacity: tuple[tuple[int, ...], ...]  # [L][K], some below the prompt width and budgets
  prompt: int  # T, the padded width of every prefill
  group: int = 2  # G, query heads per KV head

  def cache(self) -> PagedKVCache:
    return PagedKVCache.create(batch_size=self.batch, capacity=self.capacity,
                               num_layers=self.layers, num_kv_heads=self.kv_heads,
                               head_dim=self.head_dim, page_size=self.page_size)


CONFIGS = (
    Config(batch=3, layers=2, kv_heads=2, head_dim=4, page_size=4,
           capacity=((16, 8), (12, 16)), prompt=16),
    Config(batch=2, layers=1, kv_heads=2, head_dim=8, page_size=2, capacity=((6, 10),),
           prompt=12),
    Config(batch=3, layers=2, kv_heads=1, head_dim=4, page_size=8, capacity=((32,), (16,)),
           prompt=24),
)

# Prefill selections: "all" (every token), "random" (a random subset), or a policy.
POLICIES = (
    ("streaming_llm", dict(n_sink=2), 6),
    ("snapkv", dict(window=3, kernel=3), 7),
    ("pyramidkv", dict(window=2, kernel=1, beta=4), 8),
    ("knorm", {}, 5),
    ("h2o", dict(recent=2), 6),
    ("chunkkv", dict(window=2, kernel=1, chunk_length=3), 7),
    ("sentencekv", dict(window=2, kernel=1, delimiter_ids=(1,)), 7),
)
SELECTORS = ("all", "random") + tuple(range(len(POLICIES)))
EXACT = ("streaming_llm", "snapkv", "pyramidkv", "knorm", "h2o", "sentencekv")
# Decode-time evictions: (policy, smallest useful limit).
EVICTORS = ((policies.get("streaming_llm", n_sink=2), 3), (policies.get("h2o", recent=2), 3))


# ------------------------------------------------------------------ compiled operations
# One program per configuration (shapes and static fields), reused by every example.


@jax.jit
def _reserve(cache, lengths):
  return cache.reserve(lengths)


@functools.partial(jax.jit, static_argnames=("mode",))
def _decode(cache, k, v, positions, *, mode):
  """k, v: [L, B, 1, K, H]; positions: [B, 1]. The layer is traced, as in the model's scan.

  mode: "append" (no reserve), "reserve" (reserve, then each layer's append) or
  "step" (``open_token_slots``, then each layer's ``write_token``, as generate's
  decode does).
  """
  k, v = jnp.asarray(k), jnp.asarray(v)
  if mode == "step":
    cache, slots = cache.open_token_slots(positions[:, 0])
    return jax.lax.fori_loop(0, cache.num_layers,
                             lambda l, c: c.write_token(l, k[l], v[l], slots[:, l]), cache)
  if mode == "reserve":
    cache = cache.reserve(cache.lengths + 1)
  return jax.lax.fori_loop(0, cache.num_layers,
                           lambda l, c: c.append(l, k[l], v[l], positions), cache)


@functools.partial(jax.jit, static_argnums=0)
def _evict(policy, cache, limit, positions):
  return policy.before_decode_step(execution.Execution(), cache, limit, positions)


@jax.jit
def _remove(cache, slots):
  return cache.remove(slots)


@jax.jit
def _reset(cache, sequences):
  return cache.reset(sequences)


@jax.jit
def _prefill_batch(cache, q, k, v, positions, lengths, tokens, slots, scores):
  """prefill_attention in every layer, its select returning the given slots [L, B, K, T]."""
  q, k, v, slots, scores = map(jnp.asarray, (q, k, v, slots, scores))  # indexed by traced l
  select = lambda layer, prompt, q, k, v: (slots[layer], scores[layer])

  def layer(l, c):
    return attention.prefill_attention(c, l, q[l], k[l], v[l], positions, lengths,
                                       tokens=tokens, select=select)[0]

  return jax.lax.fori_loop(0, cache.num_layers, layer, cache)


@jax.jit
def _prefill_rows(cache, k, v, positions, slots, scores, chosen):
  """prefill_attention's cache steps for the chosen rows [B] only; other rows keep theirs."""
  k, v, slots, scores = map(jnp.asarray, (k, v, slots, scores))

  def layer(l, c):
    kept = (jnp.max(slots[l], axis=-1) + 1).astype(jnp.int32)  # [B, K]
    c = c.set_lengths(l, jnp.where(chosen[:, None], kept, c.lengths[:, l]))
    c = c.reserve(c.lengths)
    return c.write(l, k[l], v[l], slots[l], positions, scores[l])

  return jax.lax.fori_loop(0, cache.num_layers, layer, cache)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _select(policy, layout, layer, prompt, q, k, v):
  slots, scores = policy.select(execution.Execution(), layout)(layer, prompt, q, k, v)
  return slots, (jnp.zeros(slots.shape, jnp.float32) if scores is None else scores)


@jax.jit
def _attend(q, k_pages, v_pages, table, lengths):
  return paged_attention_reference(q, k_pages, v_pages, table, lengths)


@jax.jit
def _kept_positions(cache):
  return cache.kept_positions()


# ------------------------------------------------------------------ the reference


@dataclasses.dataclass
class Entry:
  position: int
  key: np.ndarray  # [H]
  value: np.ndarray  # [H]
  score: float


class Reference:
  """The cache as plain Python: entries[b][l][k] is a list indexed by slot."""

  def __init__(self, cfg: Config):
    self.cfg = cfg
    b, l, k = cfg.batch, cfg.layers, cfg.kv_heads
    self.entries = [[[[] for _ in range(k)] for _ in range(l)] for _ in range(b)]
    self.pages = np.zeros((b, l, k), np.int64)  # pages each head owns
    self.next_pos = np.zeros(b, np.int64)  # position of each sequence's next token

  def heads(self):
    for b in range(self.cfg.batch):
      for l in range(self.cfg.layers):
        for k in range(self.cfg.kv_heads):
          yield b, l, k

  def cap(self, l, k) -> int:
    return self.cfg.capacity[l][k]

  def lengths(self) -> np.ndarray:
    out = np.zeros(self.pages.shape, np.int64)
    for b, l, k in self.heads():
      out[b, l, k] = len(self.entries[b][l][k])
    return out

  def reserve(self, lengths: np.ndarray) -> None:
    for b, l, k in self.heads():
      need = math.ceil(min(int(lengths[b, l, k]), self.cap(l, k)) / self.cfg.page_size)
      self.pages[b, l, k] = max(self.pages[b, l, k], need)

  def empty(self, b) -> bool:
    return all(not self.entries[b][l][k] for l in range(self.cfg.layers)
               for k in range(self.cfg.kv_heads))

  def prefill(self, b, l, k, entries: list[Entry]) -> None:
    """A head of an empty sequence keeps ``entries`` (in slot order) up to its capacity."""
    self.entries[b][l][k] = entries[:self.cap(l, k)]
    self.reserve(self.lengths())

  def append(self, b, l, k, entry: Entry) -> None:
    head = self.entries[b][l][k]
    if len(head) < self.cap(l, k) and len(head) < self.pages[b, l, k] * self.cfg.page_size:
      head.append(entry)

  def remove(self, b, l, k, slot: int) -> Entry | None:
    head = self.entries[b][l][k]
    if not 0 <= slot < len(head):
      return None
    evicted = head[slot]
    last = head.pop()
    if slot < len(head):
      head[slot] = last
    return evicted

  def free_empty_pages(self) -> None:
    """An eviction (a compaction of every head) frees each head's pages past its entries."""
    for b, l, k in self.heads():
      need = math.ceil(len(self.entries[b][l][k]) / self.cfg.page_size)
      self.pages[b, l, k] = min(self.pages[b, l, k], need)

  def reset(self, b) -> None:
    for l in range(self.cfg.layers):
      for k in range(self.cfg.kv_heads):
        self.entries[b][l][k] = []
    self.pages[b] = 0
    self.next_pos[b] = 0

  def evict_choice(self, policy, b, l, k) -> int:
    """The slot ``policy`` gives up in a full head, worked out from the entries."""
    head, now = self.entries[b][l][k], int(self.next_pos[b])
    if policy.name == "streaming_llm":
      candidates = [(e.position, s) for s, e in enumerate(head) if e.position >= policy.n_sink]
    else:  # h2o: lowest accumulated score outside the recent window, first slot on ties
      candidates = [(e.score, s) for s, e in enumerate(head)
                    if e.position <= now - 1 - policy.recent]
    assert candidates, f"{policy.name}: a full head ({len(head)}) with nothing to evict"
    return min(candidates)[1]


# ------------------------------------------------------------------ the program


@st.composite
def programs(draw):
  cfg = draw(st.sampled_from(CONFIGS))
  b = cfg.batch
  mask = st.lists(st.booleans(), min_size=b, max_size=b)
  seed = st.integers(0, 2**31 - 1)
  ops = st.one_of(
      st.tuples(st.just("prefill"), mask, st.lists(st.integers(1, cfg.prompt), min_size=b,
                                                   max_size=b),
                st.sampled_from(SELECTORS), seed),
      # A few steps at a time, under a limit that full heads reach.
      st.tuples(st.just("decode"), st.sampled_from((None,) + tuple(range(len(EVICTORS)))),
                st.integers(3, 10), st.integers(1, 4), seed),
      st.tuples(st.just("unreserved_append"), seed),
      st.tuples(st.just("remove"), seed),
      st.tuples(st.just("reset"), mask),
  )
  first = st.tuples(st.just("prefill"), st.just([True] * b),
                    st.lists(st.integers(1, cfg.prompt), min_size=b, max_size=b),
                    st.sampled_from(SELECTORS), seed)
  return cfg, [draw(first)] + draw(st.lists(ops, min_size=2, max_size=MAX_OPS - 1))


class Run:
  """Applies a program to a cache and to the reference, checking after every step."""

  def __init__(self, cfg: Config, check_every_step: bool = True, jit: bool = True):
    # jit=False calls the operations op by op (each jnp call dispatched on its own).
    self.op = (lambda f: f) if jit else (lambda f: f.__wrapped__)
    self.cfg = cfg
    self.cache = cfg.cache()
    self.ref = Reference(cfg)
    self.check_every_step = check_every_step
    self.states_checked = 0

  def run(self, ops):
    self.check()
    for op in ops:
      getattr(self, op[0])(*op[1:])
      if self.check_every_step:
        self.check(op)
    return self.cache

  # -------------------------------------------------------------- operations

  def prefill(self, mask, lengths, selector, seed):
    cfg, ref = self.cfg, self.ref
    chosen = np.array([m and ref.empty(b) for b, m in enumerate(mask)])
    if not chosen.any():
      return
    rng = np.random.default_rng(seed)
    b, t, l, kh, h = cfg.batch, cfg.prompt, cfg.layers, cfg.kv_heads, cfg.head_dim
    n = kh * cfg.group
    q = rng.standard_normal((l, b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((l, b, t, kh, h)).astype(np.float32)
    v = rng.standard_normal((l, b, t, kh, h)).astype(np.float32)
    tokens = rng.integers(0, 4, (b, t)).astype(np.int32)
    lengths = np.asarray(lengths, np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    valid = np.arange(t)[None, None, :] < lengths[:, None, None]  # [B, 1, T]
    scores = rng.standard_normal((l, b, kh, t)).astype(np.float32)
    promise = None
    if selector == "all":
      slots = np.where(valid, np.arange(t), EMPTY).astype(np.int32)
      slots = np.broadcast_to(slots, (l, b, kh, t)).copy()
    elif selector == "random":
      keep = (rng.random((l, b, kh, t)) < rng.random()) & valid
      slots = np.where(keep, np.cumsum(keep, -1) - 1, EMPTY).astype(np.int32)
    else:
      name, fields, budget = POLICIES[selector]
      policy = policies.get(name, **fields)
      layout = testing.layout_for(policy, budget, t, num_layers=l, num_kv_heads=kh)
      prompt = Prompt(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths))
      select = self.op(_select)
      slots, scores = zip(*(select(policy, layout, layer, prompt, q[layer], k[layer],
                                   v[layer]) for layer in range(l)))
      slots, scores = np.stack(slots), np.stack(scores)
      promise = (name, fields, layout.budgets)
    slots = np.where(chosen[None, :, None, None], slots, EMPTY).astype(np.int32)
    hypothesis.event(f"prefill: {selector if isinstance(selector, str) else POLICIES[selector][0]}"
                     f" through {'prefill_attention' if chosen.all() else 'rows'}")
    if chosen.all():
      self.cache = self.op(_prefill_batch)(self.cache, q, k, v, positions, lengths, tokens,
                                           slots, scores)
    else:
      self.cache = self.op(_prefill_rows)(self.cache, k, v, positions, slots, scores, chosen)
    for bi, li, ki in ref.heads():
      if not chosen[bi]:
        continue
      row = slots[li, bi, ki]
      kept = np.nonzero(row >= 0)[0]
      # Selections are dense and in order; the cache relies on it (kept = max slot + 1).
      np.testing.assert_array_equal(row[kept], np.arange(kept.size))
      if kept.size > ref.cap(li, ki):
        hypothesis.event("prefill: selection above capacity (clamped)")
      ref.prefill(bi, li, ki, [Entry(int(positions[bi, ti]), k[li, bi, ti, ki],
                                     v[li, bi, ti, ki], float(scores[li, bi, ki, ti]))
                               for ti in kept])
    ref.next_pos[chosen] = lengths[chosen]
    if promise is not None:
      self._check_prefill_promise(promise, chosen, lengths)

  def _check_prefill_promise(self, promise, chosen, lengths):
    name, fields, budgets = promise
    for b, l, k in self.ref.heads():
      budget, n = budgets[l], int(lengths[b])
      if not chosen[b] or self.ref.cap(l, k) < budget:
        continue
      kept = [e.position for e in self.ref.entries[b][l][k]]
      where = f"{name} {fields}, budget {budget}, head {(b, l, k)}, length {n}"
      if name in EXACT:
        assert len(kept) == min(budget, n), f"{where}: kept {len(kept)}"
      assert len(kept) <= budget, f"{where}: kept {len(kept)}"
      forced = set()
      if name == "streaming_llm":
        forced = set(range(min(fields["n_sink"], n))) | set(
            range(max(n - (budget - fields["n_sink"]), 0), n))
      elif name in ("snapkv", "pyramidkv", "sentencekv", "h2o"):
        window = fields.get("window", fields.get("recent"))
        forced = set(range(max(n - window, 0), n))
      missing = forced - set(kept)
      assert not missing, f"{where}: sinks/window {sorted(missing)} not kept"

  def decode(self, evictor, limit, steps, seed):
    rng = np.random.default_rng(seed)
    for step in range(steps):
      self._decode_step(evictor, limit, rng)
      if self.check_every_step and step < steps - 1:
        self.check(("decode",))

  def _decode_step(self, evictor, limit, rng):
    ref = self.ref
    positions = ref.next_pos.astype(np.int32)
    if evictor is not None:
      policy, smallest = EVICTORS[evictor]
      limit = np.full(ref.pages.shape, max(limit, smallest), np.int32)
      lengths = ref.lengths()
      self.cache = self.op(_evict)(policy, self.cache, limit, positions)
      for b, l, k in ref.heads():
        if lengths[b, l, k] >= limit[b, l, k]:
          hypothesis.event(f"decode: {policy.name} evicts")
          slot = ref.evict_choice(policy, b, l, k)
          gone = ref.remove(b, l, k, slot)
          if policy.name == "streaming_llm":
            assert gone.position >= policy.n_sink, "streaming_llm evicted a sink"
          else:
            assert gone.position <= positions[b] - 1 - policy.recent, "h2o evicted a recent token"
      ref.free_empty_pages()
    self._append(rng, positions, reserve=True)

  def unreserved_append(self, seed):
    self._append(np.random.default_rng(seed), self.ref.next_pos.astype(np.int32), reserve=False)

  def _append(self, rng, positions, reserve):
    cfg, ref = self.cfg, self.ref
    shape = (cfg.layers, cfg.batch, 1, cfg.kv_heads, cfg.head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    mode = ("reserve", "step")[rng.integers(2)] if reserve else "append"
    self.cache = self.op(_decode)(self.cache, k, v, positions[:, None], mode=mode)
    if reserve:
      ref.reserve(ref.lengths() + 1)
    before = ref.lengths()
    for b, l, kh in ref.heads():
      ref.append(b, l, kh, Entry(int(positions[b]), k[l, b, 0, kh], v[l, b, 0, kh], 0.0))
    ref.next_pos += 1
    dropped = (ref.lengths() == before)
    if dropped.any():
      full = before >= np.asarray(cfg.capacity)[None]
      hypothesis.event(f"append dropped: {'at capacity' if (dropped & full).any() else ''}"
                       f"{' no page' if (dropped & ~full).any() else ''}")

  def remove(self, seed):
    rng = np.random.default_rng(seed)
    # Mostly filled slots; also -1 and slots at or past the length (to be ignored).
    slots = rng.integers(-1, self.ref.lengths() + 2).astype(np.int32)
    self.cache = self.op(_remove)(self.cache, slots)
    removed = [self.ref.remove(b, l, k, int(slots[b, l, k])) for b, l, k in self.ref.heads()]
    self.ref.free_empty_pages()
    hypothesis.event(f"remove: {sum(e is not None for e in removed)} of {len(removed)} in range")

  def reset(self, mask):
    hypothesis.event("reset" + (" (pages released)" if any(
        m and self.ref.pages[b].any() for b, m in enumerate(mask)) else ""))
    self.cache = self.op(_reset)(self.cache, np.asarray(mask, bool))
    for b, m in enumerate(mask):
      if m:
        self.ref.reset(b)

  # -------------------------------------------------------------- invariants

  def check(self, op=None):
    cfg, ref, cache = self.cfg, self.ref, self.cache
    self.states_checked += 1
    after = f"after {op[0] if op else 'create'}"
    # 1. Pages: accounting, and each head owns what the reference says.
    testing.assert_cache_consistent(cache)
    table = np.asarray(cache.page_table)
    np.testing.assert_array_equal((table >= 0).sum(-1), ref.pages, err_msg=f"pages {after}")
    # 2. Lengths.
    lengths = np.asarray(cache.lengths)
    np.testing.assert_array_equal(lengths, ref.lengths(), err_msg=f"lengths {after}")
    # 3. Content of every kept slot.
    b, l, kh, p_max = table.shape
    ps = cfg.page_size
    per_slot = lambda pool: pool[np.maximum(table, 0)].reshape(b, l, kh, p_max * ps,
                                                               *pool.shape[2:])
    keys, values = per_slot(np.asarray(cache.k_pages)), per_slot(np.asarray(cache.v_pages))
    positions, scores = per_slot(np.asarray(cache.positions)), per_slot(np.asarray(cache.scores))
    kept = np.asarray(_kept_positions(cache))
    for bi, li, ki in ref.heads():
      head = ref.entries[bi][li][ki]
      n = len(head)
      where = f"head {(bi, li, ki)} {after}"
      want_pos = np.full(p_max * ps, EMPTY)
      want_pos[:n] = [e.position for e in head]
      np.testing.assert_array_equal(kept[bi, li, ki], want_pos, err_msg=f"positions of {where}")
      np.testing.assert_array_equal(positions[bi, li, ki, :n], want_pos[:n], err_msg=where)
      if n:
        np.testing.assert_array_equal(keys[bi, li, ki, :n], np.stack([e.key for e in head]),
                                      err_msg=f"keys of {where}")
        np.testing.assert_array_equal(values[bi, li, ki, :n], np.stack([e.value for e in head]),
                                      err_msg=f"values of {where}")
        np.testing.assert_array_equal(scores[bi, li, ki, :n], [e.score for e in head],
                                      err_msg=f"scores of {where}")
    # 5. Attention over the pages = dense attention over the reference; isolation.
    rng = np.random.default_rng(self.states_checked)
    k_pages, v_pages = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
    for li in range(l):
      q = rng.standard_normal((b, kh * cfg.group, cfg.head_dim)).astype(np.float32)
      out = np.asarray(_attend(q, k_pages, v_pages, table[:, li], lengths[:, li]))
      testing.assert_close(out, self._dense(q, li))
      for bi in range(b):
        # Every page this sequence does not own (other sequences' and free ones) -> NaN.
        foreign = np.setdiff1d(np.arange(cache.num_pages), table[bi][table[bi] >= 0])
        k_bad, v_bad = k_pages.copy(), v_pages.copy()
        k_bad[foreign] = np.nan
        v_bad[foreign] = np.nan
        alone = np.asarray(_attend(q, k_bad, v_bad, table[:, li], lengths[:, li]))
        np.testing.assert_array_equal(alone[bi], out[bi],
                                      err_msg=f"sequence {bi}, layer {li} {after}")

  def _dense(self, q, layer):
    """Attention of q [B, N, H] over the reference's entries of a layer: [B, N, H]."""
    cfg = self.cfg
    out = np.zeros(q.shape, np.float64)
    for b in range(cfg.batch):
      for k in range(cfg.kv_heads):
        head = self.ref.entries[b][layer][k]
        if not head:
          continue  # an empty head attends to nothing: zeros
        keys = np.stack([e.key for e in head]).astype(np.float64)
        values = np.stack([e.value for e in head]).astype(np.float64)
        for g in range(cfg.group):
          n = k * cfg.group + g
          logits = keys @ q[b, n] / np.sqrt(cfg.head_dim)
          w = np.exp(logits - logits.max())
          out[b, n] = (w / w.sum()) @ values
    return out


# ------------------------------------------------------------------ tests


@SETTINGS
@hypothesis.given(programs())
def test_random_programs_keep_every_invariant(program):
  cfg, ops = program
  run = Run(cfg)
  run.run(ops)
  hypothesis.event(f"states checked: {min(run.states_checked // 5 * 5, 20)}+")


# ------------------------------------------------------------------ equivalences
# Fewer examples (EXAMPLES // 25 = 6 and EXAMPLES // 40 = 3 by default): each runs
# a program several times, one of them op by op, or through the Pallas interpreter.

EQUIVALENCE_SETTINGS = hypothesis.settings(SETTINGS, max_examples=max(EXAMPLES // 25, 4))


def _assert_same_cache(a: PagedKVCache, b: PagedKVCache, exact_scores: bool = True) -> None:
  for name in ("k_pages", "v_pages", "positions", "page_table", "lengths", "free_pages",
               "num_free"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  if exact_scores:
    np.testing.assert_array_equal(a.scores, b.scores, err_msg="scores")
  else:  # policy scores are float math that XLA may fuse differently under jit
    testing.assert_close(a.scores, b.scores)


@EQUIVALENCE_SETTINGS
@hypothesis.given(programs())
def test_jit_and_no_jit_agree_and_a_program_is_deterministic(program):
  cfg, ops = program
  jitted = Run(cfg, check_every_step=False).run(ops)
  _assert_same_cache(Run(cfg, check_every_step=False).run(ops), jitted)  # bit for bit
  eager = Run(cfg, check_every_step=False, jit=False).run(ops)
  _assert_same_cache(eager, jitted, exact_scores=False)


@functools.partial(jax.jit, static_argnames=("backend",))
def _decode_attention(cache, layer, q, k, v, positions, *, backend):
  cache = cache.reserve(cache.lengths + 1)
  return attention.decode_attention(cache, layer, q, k, v, positions, accumulate=True,
                                    ex=execution.create(backend))


@hypothesis.settings(EQUIVALENCE_SETTINGS, max_examples=max(EXAMPLES // 40, 3))
@hypothesis.given(programs(), st.integers(0, 2**31 - 1))
def test_pallas_decode_equals_xla_on_random_caches(program, seed):
  # The kernel (interpret mode) on caches whose pages were recycled in any order,
  # including its isolation: NaN in every page a sequence does not own.
  cfg, ops = program
  run = Run(cfg, check_every_step=False)
  cache = run.run(ops)
  rng = np.random.default_rng(seed)
  b, kh, h = cfg.batch, cfg.kv_heads, cfg.head_dim
  q = rng.standard_normal((b, 1, kh * cfg.group, h)).astype(np.float32)
  k = rng.standard_normal((b, 1, kh, h)).astype(np.float32)
  v = rng.standard_normal((b, 1, kh, h)).astype(np.float32)
  positions = run.ref.next_pos.astype(np.int32)[:, None]
  for layer in range(cfg.layers):
    xla_cache, xla = _decode_attention(cache, layer, q, k, v, positions, backend="xla")
    pallas_cache, pallas = _decode_attention(cache, layer, q, k, v, positions, backend="pallas")
    testing.assert_close(pallas, xla)
    _assert_same_cache(pallas_cache, xla_cache, exact_scores=False)
    table = np.asarray(xla_cache.page_table)
    for bi in range(b):
      foreign = np.setdiff1d(np.arange(cache.num_pages), table[bi][table[bi] >= 0])
      poisoned = cache.replace(k_pages=cache.k_pages.at[foreign].set(np.nan),
                               v_pages=cache.v_pages.at[foreign].set(np.nan))
      _, alone = _decode_attention(poisoned, layer, q, k, v, positions, backend="pallas")
      np.testing.assert_array_equal(np.asarray(alone)[bi], np.asarray(pallas)[bi])
