"""AdaKV: a layer's budget split across its KV heads (hand-computed inputs), and its cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache.attention import Prompt
from kvjax.policies import selection

NEG = -np.inf
EX = execution.Execution()


def _keep(policy, prompt, q, k, budget):
  """bool [B, K, T] what ``policy`` keeps of one layer (pages of one slot, nothing after)."""
  layout = testing.layout_for(policy, budget, q.shape[1], num_kv_heads=k.shape[2])
  return np.asarray(policy.select(EX, layout)(0, prompt, q, k, k)[0]) >= 0


def _budgets(scores, total, floor):
  scores = jnp.asarray(scores, jnp.float32)
  return np.asarray(selection.head_budgets(scores, total, floor, total)).tolist()


class TestHeadBudgets:

  def test_the_head_holding_the_top_scores_gets_more(self):
    # Each head first takes its best token (floor 1); the other 4 of 6 entries
    # go to the best scores left in either head: 0.8, 0.7, 0.6 (head 0) and
    # then 0.05 (head 1) above head 0's 0.0.
    scores = [[[0.9, 0.8, 0.7, 0.6, 0.0, 0.0],
               [0.95, 0.05, 0.01, 0.01, 0.01, 0.01]]]
    assert _budgets(scores, 6, 1) == [[4, 2]]

  def test_the_floor_holds_when_one_head_has_every_top_score(self):
    scores = [[[5.0] * 6, [0.1] * 6]]
    assert _budgets(scores, 6, 2) == [[4, 2]]
    assert _budgets(scores, 6, 3) == [[3, 3]]  # floor = budget: an even split
    assert _budgets(scores, 6, 0) == [[6, 0]]

  def test_sums_to_the_layers_budget_per_sequence(self):
    rng = np.random.default_rng(0)
    scores = rng.random((3, 4, 40)).astype(np.float32)
    got = np.asarray(_budgets(scores, 4 * 7, 2))
    assert (got.sum(-1) == 28).all() and (got >= 2).all() and (got <= 28 - 3 * 2).all()

  def test_padding_is_never_counted(self):
    # 3 valid tokens per head: a budget of 8 keeps the 6 there are.
    scores = [[[0.3, 0.2, 0.1, NEG, NEG], [0.6, 0.5, 0.4, NEG, NEG]]]
    assert _budgets(scores, 8, 1) == [[3, 3]]

  def test_traced_budget_and_floor(self):
    scores = jnp.asarray([[[0.9, 0.8, 0.7, 0.6, 0.0, 0.0],
                           [0.95, 0.05, 0.01, 0.01, 0.01, 0.01]]])
    f = jax.jit(lambda s, total, floor: selection.head_budgets(s, total, floor, 12))
    assert np.asarray(f(scores, 6, 1)).tolist() == [[4, 2]]
    assert np.asarray(f(scores, 4, 2)).tolist() == [[2, 2]]

  def test_keep_top_takes_one_budget_per_head(self):
    scores = jnp.asarray([[[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]]])
    keep = np.asarray(selection.keep_top(scores, jnp.asarray([[1, 3]]), 4))
    assert keep.tolist() == [[[True, False, False, False], [False, True, True, True]]]


def _prompt(t, tokens=None):
  tokens = np.arange(t) % 50 if tokens is None else tokens
  return Prompt(jnp.asarray([tokens], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
                jnp.asarray([t], jnp.int32))


class TestPolicy:

  def test_fields_floor_and_refusals(self):
    policy = policies.get("adakv")
    assert policy.inner == policies.get("snapkv") and policy.floor == 0.2
    assert policies.get("adakv", inner="sablock").inner == policies.get("sablock")
    # The floor never drops below the window the inner policy always keeps.
    assert policies.get("adakv", inner="snapkv").head_floor(128) == 64
    assert policies.get("adakv", inner="sablock").head_floor(128) == 26  # ceil(0.2 * 128)
    assert policies.get("adakv", inner="knorm", floor=0.0).head_floor(128) == 0
    for name, why in (("duo", "outside keep"), ("paged_eviction", "during decode"),
                      ("h2o", "during decode"), ("full", "no budget")):
      with pytest.raises(ValueError, match=f"cannot wrap '{name}': .*{why}"):
        policies.get("adakv", inner=name)
    assert policies.get("adakv", window=16).inner == policies.get("snapkv", window=16)
    assert policies.get("adakv", inner="sablock", window=8).reserved() == 8
    with pytest.raises(ValueError, match="'knorm' has no observation window"):
      policies.get("adakv", inner="knorm", window=8)
    with pytest.raises(ValueError, match="floor must be"):
      policies.get("adakv", floor=1.5)
    with pytest.raises(ValueError, match="cannot compress a chunked prefill"):
      policies.get("adakv").check_chunk(512)

  def test_keeps_each_heads_budget_with_its_window(self):
    # Two KV heads, window 4, budget 8 per head, floor 0.5 -> 4 (the window).
    # Head 0's window attends to 6 tokens, head 1's to 1: head 0 gets more.
    t, window = 40, 4
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, t, 2, 8)).astype(np.float32) * 0.01
    k = rng.normal(size=(1, t, 2, 8)).astype(np.float32) * 0.01
    for h, targets in enumerate([[3, 9, 14, 20, 25, 30], [11]]):
      for target in targets:
        k[0, target, h, h] = 6.0
      q[0, t - window:, h, h] = 1.0
    policy = policies.get("adakv", inner=policies.get("snapkv", window=window, kernel=1),
                          floor=0.5)
    keep = _keep(policy, _prompt(t), q, k, 8)[0]
    tail = list(range(t - window, t))
    kept = [np.nonzero(keep[h])[0].tolist() for h in range(2)]
    assert set(tail) <= set(kept[0]) and set(tail) <= set(kept[1])
    assert {3, 9, 14, 20, 25, 30} <= set(kept[0]) and 11 in kept[1]
    assert len(kept[0]) + len(kept[1]) == 16 and len(kept[0]) > len(kept[1]) >= 4

  def test_sablock_keeps_exactly_each_heads_budget(self):
    t = 96
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, t, 2, 8)).astype(np.float32)
    k = rng.normal(size=(1, t, 2, 8)).astype(np.float32)
    tokens = np.where(np.arange(t) % 7 == 6, 13, 5)  # a delimiter (13) every 7 tokens
    prompt = _prompt(t, tokens)
    inner = policies.get("sablock", window=4, delimiter_ids=(13,), max_block=4)
    policy = policies.get("adakv", inner=inner, floor=0.25)
    scores = policy.score(EX, prompt, q, k, k)
    budgets = np.asarray(selection.head_budgets(scores, 2 * 24, policy.head_floor(24), 48))
    keep = _keep(policy, prompt, q, k, 24)
    assert budgets.sum() == 48 and (budgets >= 6).all()
    assert keep.sum(-1).tolist() == budgets.tolist()


CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=256, tie_embeddings=False,
    rope_theta=500.0)


@pytest.mark.parametrize("budget", [26, 32])  # budget + steps: whole pages, or not
def test_generate_splits_the_inner_policys_pages(budget):
  lm = kvjax.init_random(CONFIG, seed=3)
  prompt = np.random.default_rng(0).integers(0, 97, 120).tolist()
  steps, ps = 6, 16
  policy = policies.get("adakv", inner=policies.get("snapkv", window=8))
  result = kvjax.generate(lm, [prompt], policy=policy, budget=budget, max_new_tokens=steps,
                          stop_ids=[], page_size=ps)
  snap = kvjax.generate(lm, [prompt], policy=policies.get("snapkv", window=8), budget=budget,
                        max_new_tokens=steps, stop_ids=[], page_size=ps)
  cache = result.cache
  assert cache.kv_bytes == snap.cache.kv_bytes and cache.num_pages == snap.cache.num_pages
  head_pages = -(-(budget + steps) // ps)  # 2 at budget 26, 3 at 32
  lengths = np.asarray(cache.lengths)[0]  # [L, K]: kept entries + the steps - 1 appended
  kept = lengths - (steps - 1)
  assert (kept.sum(-1) == 2 * (head_pages * ps - steps)).all()  # 2 x 26 = 52; 2 x 42 = 84
  assert ((kept + steps) % ps == 0).all()  # each head in whole pages
  assert (kept >= ps - steps).all()  # the floor (the window, 8) rounded up to a page
  positions = np.asarray(cache.kept_positions())[0]  # [L, K, S]
  for l in range(3):
    for h in range(2):
      row = positions[l, h][positions[l, h] >= 0]
      assert len(set(row.tolist())) == lengths[l, h]
      assert set(range(112, 120)) <= set(row.tolist())  # the window, in every head
  layout = policy.layout(budget, prompt_len=120, extra_tokens=0, max_new_tokens=steps,
                         page_size=ps, num_kv_heads=2, windows=(0,) * 3)
  assert layout.capacity == ((2 * head_pages - 1) * ps,) * 3
  assert layout.pages == 3 * 2 * head_pages


@pytest.mark.parametrize("shared_split", [False, True])
def test_generate_splits_dynsplit_kvs_budget_across_heads(shared_split):
  lm = kvjax.init_random(CONFIG, seed=3)
  rng = np.random.default_rng(1)
  prompt = rng.integers(5, 97, 160)
  prompt[rng.random(160) < 0.1] = 2  # candidate boundaries
  inner = policies.get("dynsplit_kv", delimiter_ids=(2,), shared_split=shared_split)
  kw = dict(budget=42, max_new_tokens=6, stop_ids=[], page_size=2)  # small pages: heads differ
  result = kvjax.generate(lm, [prompt.tolist()], policy=policies.get("adakv", inner=inner), **kw)
  plain = kvjax.generate(lm, [prompt.tolist()], policy=inner, **kw)
  assert result.cache.kv_bytes == plain.cache.kv_bytes
  kept = np.asarray(result.cache.lengths)[0] - 5  # [L, K]: less the 5 tokens appended
  assert (kept.sum(-1) == 2 * 42).all() and (kept >= 16).all()  # the window (the floor)
  assert (kept != 42).any()  # the heads' shares differ somewhere


def test_whole_pages_rounds_to_the_layers_pages():
  # Pages of 16, 6 entries taken after prefill, 4 pages: 64 - 2 x 6 = 52 entries.
  tokens = np.array([[30, 22], [26, 26], [10, 42], [20, 20]], np.int32)
  budgets = np.asarray(selection.whole_pages(tokens, 4, 16, 6))
  # 36 + 28 slots: the second needs more of a page (12 of 16) and gets it.
  np.testing.assert_array_equal(budgets, [[26, 26], [26, 26], [10, 42], [26, 26]])
  np.testing.assert_array_equal(((budgets + 6) // 16).sum(-1), [4, 4, 4, 4])
  tokens = np.array([[31, 21]], np.int32)  # 37 + 27 slots: the first, 5 of 16, loses
  np.testing.assert_array_equal(selection.whole_pages(tokens, 4, 16, 6), [[26, 26]])


def test_rows_record_the_wrapped_policy():
  from kvjax.eval import policy_entries
  values = policy_entries.settings(policies.get("adakv", inner="sablock", window=8))
  assert values["inner"]["name"] == "sablock" and values["inner"]["window"] == 8
  assert policy_entries.settings_text(values).startswith(
      "inner=sablock[window=8, kernel=5, group=mean, delimiter_ids=tokenizer (0 ids), ")
  entry = policy_entries.parse("adakv:inner=sablock:window=8")
  assert entry.make(0) == policies.get("adakv", inner="sablock", window=8)
  with pytest.raises(ValueError, match="unknown policy 'sablok'"):
    policy_entries.parse("adakv:inner=sablok")
  assert "page_size" not in values and "grow" not in values  # the cache's: in its layout
  with pytest.raises(ValueError, match="page_size"):
    policy_entries.parse("adakv:page_size=16")
