"""PagedEviction, SABlock and DynSplit-KV end to end through kvjax.generate on SmolLM2.

A ~1K-token passkey prompt, budget 128, window 16: every (layer, KV head)
holds exactly the budget, the page accounting is sound, and PagedEviction
evicts whole pages while decoding with a pool sized to the budget.
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


def test_paged_eviction_decodes_with_a_pool_of_the_budget(smollm2_lm, passkey):
  policy = kvjax.policies.get("paged_eviction", window=WINDOW)
  new = 128
  r = kvjax.generate(smollm2_lm, [passkey], policy=policy, budget=BUDGET, max_new_tokens=new,
                     stop_ids=[])
  testing.assert_cache_consistent(r.cache)
  cfg = smollm2_lm.config
  assert r.stats.decode_steps == new - 1
  # The pool holds the budget and no more: no head can ever exceed it.
  assert r.stats.kv_bytes == cfg.num_layers * BUDGET * _per_slot_bytes(cfg)
  assert r.cache.capacity == ((BUDGET,) * cfg.num_kv_heads,) * cfg.num_layers
  n = r.stats.prompt_tokens[0]
  appended = new - 1  # the last sampled token is never appended
  lengths = np.asarray(r.cache.lengths)
  assert (lengths <= BUDGET).all()
  # Whole pages went: 128 + 127 entries, 8 evictions of 16 entries.
  np.testing.assert_array_equal(lengths, BUDGET + appended - 8 * 16)
  kept = np.asarray(r.cache.kept_positions())[0]
  last = n + appended - 1
  for l in range(cfg.num_layers):
    for h in range(cfg.num_kv_heads):
      row = kept[l, h][:lengths[0, l, h]]
      assert (np.diff(row) > 0).all()  # slot order is position order: pages were cut out whole
      assert row[:16].tolist() == list(range(16))  # the first page never goes
      assert row[-1] == last  # the newest token is there: nothing dropped at the append
      # Generated tokens left in runs of whole pages (no single-token holes).
      missing = sorted(set(range(n, last + 1)) - set(row.tolist()))
      assert len(missing) % 16 == 0
