"""PagedEviction, SABlock and DynSplit-KV end to end through kvjax.generate on SmolLM2.

A ~1K-token passkey prompt, budget 128, window 16: every (layer, KV head)
holds exactly the budget, the page accounting is sound, and PagedEviction
evicts whole pages while decoding, holding between its budget and a page more.
"""

import numpy as np
import pytest

import kvjax
from kvjax import testing

BUDGET, WINDOW = 128, 16


@pytest.fixture(scope="module")
def passkey(smollm2_lm):
  return kvjax.tasks.passkey_prompt(smollm2_lm.tokenizer, context_tokens=1024, seed=4).prompt


def _per_slot_bytes(cfg):
  return cfg.num_kv_heads * cfg.head_dim * 4 * 2  # float32 keys + values


@pytest.mark.parametrize("name", ["paged_eviction", "sablock", "dynsplit_kv"])
def test_cache_holds_exactly_the_budget(smollm2_lm, passkey, name):
  policy = kvjax.policies.get(name, window=WINDOW)
  r = kvjax.generate(smollm2_lm, [passkey], policy=policy, budget=BUDGET, max_new_tokens=1,
                     stop_ids=[])
  testing.assert_cache_consistent(r.cache)
  np.testing.assert_array_equal(r.cache.lengths, BUDGET)
  cfg = smollm2_lm.config
  # Pages for the budget (+ a page of room to grow for policies that do not evict).
  slots = BUDGET if policy.evicts_during_decode else BUDGET + 16
  assert r.stats.kv_bytes == cfg.num_layers * slots * _per_slot_bytes(cfg)
  n = r.stats.prompt_tokens[0]
  kept = np.asarray(r.cache.kept_positions())[0]  # [L, K, S]
  for l in range(cfg.num_layers):
    for h in range(cfg.num_kv_heads):
      row = kept[l, h][:BUDGET]
      assert len(set(row.tolist())) == BUDGET and row.min() >= 0 and row.max() < n
      assert set(range(n - WINDOW, n)) <= set(row.tolist())  # the window is kept
  if name == "paged_eviction":
    # The first page is kept, and one decision per layer: every head keeps the same.
    assert (kept[:, :, :16] == np.arange(16)).all()
    assert (kept == kept[:, :1]).all()


@pytest.mark.parametrize("query_aware", [False, True], ids=["query-agnostic", "query-aware"])
def test_paged_eviction_decodes_within_a_page_of_the_budget(smollm2_lm, passkey, query_aware):
  policy = kvjax.policies.get("paged_eviction", window=WINDOW)
  question = " What is the pass key? The pass key is"
  q = len(smollm2_lm.tokenizer.encode(question))
  new = 128
  r = kvjax.generate(smollm2_lm, [passkey], questions=[question], query_aware=query_aware,
                     policy=policy, budget=BUDGET, max_new_tokens=new, stop_ids=[],
                     pad_multiple=16)
  testing.assert_cache_consistent(r.cache)
  cfg = smollm2_lm.config
  assert r.stats.decode_steps == new - 1
  # A head appends past its limit until its tail page is full, then gives a page
  # back: the pool holds the limit (with the question padded to 16) rounded up
  # past one more entry.
  limit = BUDGET + (0 if query_aware else q)
  capacity = -(-(BUDGET + (0 if query_aware else 16) + 1) // 16) * 16
  assert r.cache.capacity == ((capacity,) * cfg.num_kv_heads,) * cfg.num_layers
  assert r.stats.kv_bytes == cfg.num_layers * capacity * _per_slot_bytes(cfg)
  length = limit
  for _ in range(new - 1):  # the last sampled token is never appended
    length -= 16 if length > limit and length % 16 == 0 else 0
    length += 1
  lengths = np.asarray(r.cache.lengths)
  np.testing.assert_array_equal(lengths, length)
  n = r.stats.prompt_tokens[0]
  kept = np.asarray(r.cache.kept_positions())[0]
  last = n + new - 2
  for l in range(cfg.num_layers):
    for h in range(cfg.num_kv_heads):
      row = kept[l, h][:lengths[0, l, h]]
      assert (np.diff(row) > 0).all()  # slot order is position order: pages were cut out whole
      assert row[:16].tolist() == list(range(16))  # the first page never goes
      assert set(range(n - q, n)) <= set(row.tolist())  # nor a page holding the question
      assert row[-1] == last  # the newest token is there: nothing dropped at the append
      # Generated tokens left in runs of whole pages (no single-token holes).
      missing = sorted(set(range(n, last + 1)) - set(row.tolist()))
      assert len(missing) % 16 == 0 and missing


def test_dynsplit_shared_split_runs_alone_and_among_runs(smollm2_lm, passkey):
  # One split for all layers needs every layer's density first: generate
  # records the prompt's forward even for this one run, and the result is the
  # one the run gets among others (the shared record path).
  shared = kvjax.policies.get("dynsplit_kv", window=WINDOW, shared_split=True)
  alone = kvjax.generate(smollm2_lm, [passkey], policy=shared, budget=BUDGET, max_new_tokens=8)
  assert alone.stats.shared_prefill_s > 0
  testing.assert_cache_consistent(alone.cache)
  np.testing.assert_array_equal(alone.cache.lengths, BUDGET + 7)  # 7 tokens appended
  per_layer, among = kvjax.generate_each(
      smollm2_lm, [passkey], [(kvjax.policies.get("dynsplit_kv", window=WINDOW), BUDGET),
                              (shared, BUDGET)], max_new_tokens=8)
  assert among.token_ids == alone.token_ids
  np.testing.assert_array_equal(among.cache.kept_positions(), alone.cache.kept_positions())
  assert not np.array_equal(per_layer.cache.kept_positions(), among.cache.kept_positions())
