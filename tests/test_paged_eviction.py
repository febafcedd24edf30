"""PagedEviction: norm-scored prefill, whole-page eviction while decoding, on hand-made inputs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import PagedKVCache
from kvjax.cache import Prompt
from kvjax.policies import paged_eviction

T, K, G, H, PS = 48, 2, 3, 8, 4
EX = execution.Execution()


def _prompt(length=T):
  return Prompt(None, jnp.arange(T, dtype=jnp.int32)[None], jnp.asarray([length], jnp.int32))


def _kv(v_norms, k_norms=None):
  """k, v [1, T, K, H] with the given per-(token, head) norms along one axis."""
  v_norms = np.asarray(v_norms, np.float32)
  k_norms = np.ones_like(v_norms) if k_norms is None else np.asarray(k_norms, np.float32)
  k = np.zeros((1, T, K, H), np.float32)
  v = np.zeros((1, T, K, H), np.float32)
  k[0, :, :, 0] = k_norms
  v[0, :, :, 1] = v_norms
  return jnp.asarray(k), jnp.asarray(v)


def _kept(policy, budget, k, v, length=T):
  select = policy.select(EX, testing.layout_for(policy, budget, T))
  slots, _ = select(0, _prompt(length), jnp.zeros((1, T, K * G, H)), k, v)
  slots = np.asarray(slots)[0]
  return [np.nonzero(slots[h] >= 0)[0].tolist() for h in range(K)], slots


class TestScores:

  @pytest.mark.parametrize("variant,want", [("v_over_k", 2.0), ("v", 4.0), ("inv_k", 0.5),
                                            ("k_plus_v", 6.0)])
  def test_variants(self, variant, want):
    got = paged_eviction.norm_scores(jnp.asarray([2.0]), jnp.asarray([4.0]), variant)
    chex.assert_trees_all_close(got, jnp.asarray([want]))

  def test_a_zero_key_scores_finite(self):
    # ||k|| is clamped at 1e-6, so a zero key cannot outrank every other token by +inf.
    got = paged_eviction.norm_scores(jnp.asarray([0.0, 1.0]), jnp.asarray([1.0, 1.0]),
                                     "v_over_k")
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, jnp.asarray([1e6, 1.0]))

  def test_bad_fields(self):
    with pytest.raises(ValueError, match="variant must be one of"):
      policies.get("paged_eviction", variant="attention")
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
      policies.get("paged_eviction", page_size=0)
    with pytest.raises(ValueError, match="must exceed the 32 entries"):
      policies.get("paged_eviction").validate(32)


class TestPrefill:

  def test_keeps_first_and_last_pages_then_the_highest_v_over_k(self):
    rng = np.random.default_rng(0)
    v_norms = rng.uniform(1, 2, size=(T, K))
    v_norms[[9, 21, 30], :] = 10.0  # high ||v||
    k_norms = np.ones((T, K))
    k_norms[17, :] = 0.1  # low ||k||: 1 / 0.1 = 10 per unit of ||v||
    k, v = _kv(v_norms, k_norms)
    budget = 2 * PS + 4
    kept, slots = _kept(policies.get("paged_eviction", page_size=PS), budget, k, v, length=46)
    # First page 0-3, last partial page 44-45 (46 tokens), then 9, 17, 21, 30 and
    # the best of the rest; both heads alike (one decision per layer).
    assert kept[0] == kept[1]
    assert {0, 1, 2, 3, 44, 45, 9, 17, 21, 30} <= set(kept[0])
    assert len(kept[0]) == budget and max(kept[0]) < 46
    # Laid out in original order: slots 0, 1, ... in position order.
    assert slots[0][kept[0]].tolist() == list(range(budget))

  def test_per_head_decides_per_head(self):
    v_norms = np.ones((T, K))
    v_norms[10, 0] = v_norms[20, 1] = 10.0
    k, v = _kv(v_norms)
    kept, _ = _kept(policies.get("paged_eviction", page_size=PS, per_head=True), 2 * PS + 1,
                    k, v)
    assert kept[0] == [0, 1, 2, 3, 10, 44, 45, 46, 47]
    assert kept[1] == [0, 1, 2, 3, 20, 44, 45, 46, 47]

  def test_exactly_the_budget_and_one_compile_per_budget(self):
    policy = policies.get("paged_eviction", page_size=PS)
    rng = np.random.default_rng(1)

    def run(budget, seed):
      k, v = _kv(np.random.default_rng(seed).uniform(1, 3, (T, K)))
      layout = testing.layout_for(policy, budget, T)
      fn = jax.jit(lambda k, v: policy.select(EX, layout)(
          0, _prompt(), jnp.zeros((1, T, K * G, H)), k, v)[0])
      return fn, k, v

    fn, k, v = run(20, 0)
    with testing.count_compilations() as n:
      slots = fn(k, v)
      k2, v2 = _kv(rng.uniform(1, 3, (T, K)))
      slots2 = fn(k2, v2)
    assert n[0] == 1
    for s in (slots, slots2):
      np.testing.assert_array_equal((np.asarray(s) >= 0).sum(-1), 20)


def _full_cache(page_scores, lengths=None):
  """A cache (B=1, L=1, K=2, page size PS) whose page j holds tokens of ||v|| = page_scores[j].

  page_scores: [pages] (every head alike) or [pages, K].
  """
  page_scores = np.asarray(page_scores, np.float32)
  pages = len(page_scores)
  t = pages * PS
  cache = PagedKVCache.create(batch_size=1, capacity=t, num_layers=1, num_kv_heads=K,
                              head_dim=H, page_size=PS)
  per_page = page_scores if page_scores.ndim == 2 else page_scores[:, None].repeat(K, 1)
  v_norms = np.repeat(per_page, PS, axis=0)
  k = np.zeros((1, t, K, H), np.float32)
  v = np.zeros((1, t, K, H), np.float32)
  k[0, :, :, 0] = 1.0
  v[0, :, :, 1] = v_norms
  n = t if lengths is None else lengths
  lens = jnp.full((1, K), n, jnp.int32)
  cache = cache.set_lengths(0, lens).reserve(lens[:, None])
  slots = jnp.where(jnp.arange(t) < n, jnp.arange(t, dtype=jnp.int32), -1)
  return cache.write(0, jnp.asarray(k), jnp.asarray(v), jnp.broadcast_to(slots, (1, K, t)),
                     jnp.arange(t, dtype=jnp.int32)[None])


def _step(policy, cache, limit, question=None):
  limit = jnp.full(cache.lengths.shape, limit, jnp.int32)
  return policy.before_decode_step(EX, cache, limit, jnp.asarray([cache.max_slots], jnp.int32),
                                   None if question is None else jnp.asarray([question], jnp.int32))


def _evicted_page(out, head=0):
  """The page index (positions // PS) whose positions left head ``head``."""
  kept = set(np.asarray(out.kept_positions())[0, 0, head].tolist())
  return sorted({p // PS for p in range(out.max_slots) if p not in kept})[0]


class TestDecode:

  def test_evicts_the_lowest_page_never_the_first_or_the_tail(self):
    # Pages 0 and 4 (first, tail) score lowest, but may not go: page 2 is next.
    cache = _full_cache([0.1, 5.0, 1.0, 3.0, 0.2])
    out = _step(policies.get("paged_eviction", page_size=PS), cache, 4 * PS)
    testing.assert_cache_consistent(out)
    kept = np.asarray(out.kept_positions())[0, 0]
    want = list(range(0, 8)) + list(range(12, 20))
    for h in range(K):
      assert kept[h][:4 * PS].tolist() == want
    np.testing.assert_array_equal(out.lengths, 4 * PS)
    assert int(out.num_free) == int(cache.num_free) + K

  @pytest.mark.parametrize("length,limit", [(4 * PS - 1, 3 * PS),  # past it, tail page not full
                                            (4 * PS, 4 * PS),  # full, but not past the limit
                                            (3 * PS, 4 * PS)])  # below the limit
  def test_a_head_evicts_only_past_its_limit_with_its_tail_page_full(self, length, limit):
    cache = _full_cache([1.0, 2.0, 3.0, 4.0], lengths=length)
    out = _step(policies.get("paged_eviction", page_size=PS), cache, limit)
    np.testing.assert_array_equal(out.page_table, cache.page_table)
    np.testing.assert_array_equal(out.lengths, cache.lengths)

  def test_candidates_limit_the_choice_to_the_oldest_pages(self):
    cache = _full_cache([1.0, 5.0, 4.0, 0.5, 1.0])
    out = _step(policies.get("paged_eviction", page_size=PS, candidates=2), cache, 4 * PS)
    assert _evicted_page(out) == 2  # not 3: only pages 1 and 2 compete

  def test_pages_holding_the_question_are_never_evicted(self):
    # Page j holds positions 4j .. 4j + 3. Pages 5 and 6 score lowest, but they
    # hold the question (positions 20-27): page 1 goes instead.
    cache = _full_cache([9.0, 2.0, 3.0, 4.0, 5.0, 0.1, 0.2, 6.0])
    policy = policies.get("paged_eviction", page_size=PS)
    assert _evicted_page(_step(policy, cache, 7 * PS)) == 5
    out = _step(policy, cache, 7 * PS, question=[20, 28])
    testing.assert_cache_consistent(out)
    assert _evicted_page(out) == 1
    assert set(range(20, 28)) <= set(np.asarray(out.kept_positions())[0, 0, 0].tolist())
    # The oldest-pages candidates count the pages that may go, the question's skipped.
    oldest = policies.get("paged_eviction", page_size=PS, candidates=1)
    cache = _full_cache([9.0, 2.0, 0.1, 4.0, 0.5, 6.0])
    assert _evicted_page(_step(oldest, cache, 5 * PS, question=[4, 8])) == 2

  def test_one_decision_per_layer_unless_per_head(self):
    # Alone, head 0 would drop page 2 (1.5 < 2) and head 1 page 1 (1 < 3); summed
    # over the layer's heads page 1 (3) is lower than page 2 (4.5).
    scores = np.array([[1, 1], [2, 1], [1.5, 3], [9, 9], [1, 1]], np.float32)
    cache = _full_cache(scores)
    shared = _step(policies.get("paged_eviction", page_size=PS), cache, 4 * PS)
    own = _step(policies.get("paged_eviction", page_size=PS, per_head=True), cache, 4 * PS)
    assert [_evicted_page(shared, h) for h in range(K)] == [1, 1]
    assert [_evicted_page(own, h) for h in range(K)] == [2, 1]

  def test_between_the_budget_and_a_page_more_after_every_step(self):
    # The decode loop's bookkeeping by hand: evict, then open the token's slot.
    # A budget of 3 pages and a 5-token question (positions 12-16): the head
    # holds 17 entries, appends up to 20 (past 17, tail page full), drops a
    # page to 16 at the next step and appends to 17 again. The pool holds
    # round_up(17 + 1) = 20 slots, which the head fills and never overflows.
    policy = policies.get("paged_eviction", page_size=PS)
    budget, question = 3 * PS, 5
    capacity = policy.layout(budget, prompt_len=40, extra_tokens=question, max_new_tokens=64,
                             page_size=PS, num_kv_heads=K, windows=(0,)).capacity
    assert capacity == (20,)
    cache = _full_cache(np.linspace(1.0, 2.0, 5), lengths=budget + question)
    limit = jnp.full(cache.lengths.shape, budget + question, jnp.int32)
    span = jnp.asarray([[12, 17]], jnp.int32)
    step = jax.jit(lambda c, pos: policy.before_decode_step(EX, c, limit, pos, span)
                   .open_token_slots(pos)[0])
    lengths = []
    for i in range(24):
      cache = step(cache, jnp.asarray([17 + i], jnp.int32))
      testing.assert_cache_consistent(cache)
      lengths.append(int(cache.lengths[0, 0, 0]))
      kept = np.asarray(cache.kept_positions())[0, 0, 0].tolist()
      assert set(range(12, 17)) <= set(kept)  # the question stays
      assert 17 + i in kept  # the token just appended
    assert step._cache_size() == 1  # one program for every step
    assert lengths[:8] == [18, 19, 20, 17, 18, 19, 20, 17]
    assert min(lengths) >= budget + question and max(lengths) <= budget + question + PS

  def test_page_size_must_match_the_cache(self):
    cache = _full_cache([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="page_size=16 but the cache has page_size=4"):
      _step(policies.get("paged_eviction"), cache, 3 * PS)
