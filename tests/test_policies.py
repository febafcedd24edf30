"""What each policy keeps, on hand-made inputs; budgets, bytes and decode-time eviction."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import Prompt
from kvjax.cache.paged import round_up
from kvjax.policies import delimiters
from kvjax.policies import scoring
from kvjax.policies import selection

T, K, G, H = 48, 2, 3, 8
EX = execution.Execution()


def _prompt(lengths=(T,), tokens=None):
  b = len(lengths)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
  return Prompt(None if tokens is None else jnp.asarray(tokens), positions,
                jnp.asarray(lengths, jnp.int32))


def _kept(policy, budget, q, k, v=None, prompt=None, layer=0):
  """Original positions kept per (sequence, KV head), as sorted python lists."""
  prompt = prompt or _prompt((q.shape[1],) * q.shape[0])
  v = k if v is None else v
  layout = testing.layout_for(policy, budget, q.shape[1], num_kv_heads=k.shape[2])
  slots, _ = policy.select(EX, layout)(layer, prompt, q, k, v)
  slots = np.asarray(slots)
  return [[sorted(np.nonzero(slots[b, h] >= 0)[0].tolist()) for h in range(slots.shape[1])]
          for b in range(slots.shape[0])]


def _attending(targets_per_head, window, t=T, strength=8.0):
  """q, k where the last `window` queries of KV head h attend to targets_per_head[h]."""
  rng = np.random.default_rng(0)
  q = rng.normal(size=(1, t, K * G, H)).astype(np.float32) * 0.1
  k = rng.normal(size=(1, t, K, H)).astype(np.float32) * 0.1
  for h, targets in enumerate(targets_per_head):
    direction = np.zeros(H, np.float32)
    direction[h] = 1.0
    for target in targets:
      k[0, target, h] = strength * direction
    q[0, t - window:, h * G:(h + 1) * G] = direction
  return jnp.asarray(q), jnp.asarray(k)


class TestRegistry:

  def test_names_and_fields(self):
    fields = {name: [f.name for f in dataclasses.fields(type(policies.get(name)))]
              for name in policies.names()}
    window = ["window", "kernel", "group"]
    assert fields == {
        "full": [], "streaming_llm": ["n_sink"], "snapkv": window,
        "pyramidkv": window + ["beta"], "knorm": [], "h2o": ["recent", "group"],
        "chunkkv": window + ["chunk_length"], "sentencekv": window + ["delimiter_ids"],
        "paged_eviction": ["page_size", "variant", "per_head", "candidates", "window"],
        "sablock": window + ["delimiter_ids", "max_segment", "min_segment", "gamma", "epsilon",
                             "max_block"],
        "dynsplit_kv": window + ["delimiter_ids", "chunk", "delta", "alpha", "shared_split"],
        "adakv": ["inner", "floor", "window"],
        "duo": ["gates", "n_sink", "recent"]}
    assert policies.get("snapkv", window=16).window == 16
    assert policies.get(policies.get("snapkv"), window=16) == policies.get("snapkv", window=16)
    with pytest.raises(ValueError, match="unknown policy 'snap'"):
      policies.get("snap")
    with pytest.raises(ValueError, match=r"has no field\(s\) \['windw'\]"):
      policies.get("snapkv", windw=3)

  def test_window_fields_name_each_policys_window(self):
    assert policies.window_fields("snapkv", 16) == {"window": 16}
    assert policies.window_fields("paged_eviction", 16) == {"window": 16}
    assert policies.window_fields("h2o", 16) == {"recent": 16}
    assert policies.window_fields("knorm", 16) == {}
    assert policies.window_fields("sablock", 0) == {}

  def test_window_scored_policies_compose_one_scorer(self):
    # Not SnapKV subclasses: each holds its own fields and builds the same scorer from them.
    for name, default in (("snapkv", 64), ("pyramidkv", 64), ("chunkkv", 64), ("sentencekv", 64),
                          ("sablock", 16), ("dynsplit_kv", 16)):
      policy = policies.get(name)
      assert not isinstance(policy, policies.SnapKV) or name == "snapkv", name
      assert policy.scorer == scoring.WindowScorer(default, 5, "mean"), name
      assert policy.reserved() == default, name
      assert policies.get(name, window=8, kernel=3, group="max").scorer == scoring.WindowScorer(
          8, 3, "max"), name
      with pytest.raises(ValueError, match=f"policy '{name}': kernel must be an odd int"):
        policies.get(name, kernel=2)

  def test_budget_validation(self):
    with pytest.raises(ValueError, match="must exceed the 64 entries"):
      policies.get("snapkv").validate(64)
    with pytest.raises(ValueError, match="needs a budget"):
      policies.get("knorm").validate(None)
    with pytest.raises(ValueError, match="positive int"):
      policies.get("knorm").validate(0)


class TestWhatEachPolicyKeeps:

  def test_snapkv_keeps_what_the_window_attends_to(self):
    window = 8
    q, k = _attending([[5, 17], [30, 2]], window)
    policy = policies.get("snapkv", window=window, kernel=1)
    kept = _kept(policy, window + 2, q, k)[0]
    tail = list(range(T - window, T))
    assert kept[0] == [5, 17] + tail
    assert kept[1] == [2, 30] + tail

  def test_snapkv_pooling_protects_neighbours(self):
    window = 8
    q, k = _attending([[20], [20]], window)
    kept = _kept(policies.get("snapkv", window=window, kernel=5), window + 5, q, k)[0][0]
    assert kept[:5] == [18, 19, 20, 21, 22]

  def test_snapkv_max_group_reduction(self):
    # Only query head 0 of KV head 0 looks at token 9; the mean dilutes it, max does not.
    window = 8
    q, k = _attending([[9], []], window)
    q = q.at[0, T - window:, 1:G].set(0.0)
    kept = _kept(policies.get("snapkv", window=window, kernel=1, group="max"), window + 1, q, k)
    assert kept[0][0] == [9] + list(range(T - window, T))

  def test_streaming_llm_keeps_sinks_and_recent(self):
    q, k = _attending([[], []], 4)
    kept = _kept(policies.get("streaming_llm", n_sink=4), 12, q, k)[0]
    assert kept == [[0, 1, 2, 3] + list(range(T - 8, T))] * K

  def test_knorm_keeps_the_lowest_norm_keys(self):
    norms = np.random.default_rng(1).permutation(T * K).reshape(T, K) + 1.0
    k = np.zeros((1, T, K, H), np.float32)
    k[0, :, :, 0] = norms
    kept = _kept(policies.get("knorm"), 10, jnp.zeros((1, T, K * G, H)), jnp.asarray(k))[0]
    for h in range(K):
      assert kept[h] == sorted(np.argsort(norms[:, h])[:10].tolist())

  def test_h2o_keeps_heavy_hitters_and_recent(self):
    # Every query of KV head 0 attends to token 3, of KV head 1 to token 11.
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, T, K * G, H)).astype(np.float32) * 0.1
    k = rng.normal(size=(1, T, K, H)).astype(np.float32) * 0.1
    for h, target in enumerate((3, 11)):
      k[0, target, h, h] = 8.0
      q[0, :, h * G:(h + 1) * G, h] = 1.0
    kept = _kept(policies.get("h2o", recent=6), 7, jnp.asarray(q), jnp.asarray(k))[0]
    recent = list(range(T - 6, T))
    assert kept == [[3] + recent, [11] + recent]

  def test_chunkkv_keeps_whole_chunks_for_all_heads(self):
    window = 4
    q, k = _attending([[25], [26]], window)
    kept = _kept(policies.get("chunkkv", window=window, kernel=1, chunk_length=5), 15, q, k)[0]
    # Chunks are [0, 5), [5, 10), ...: tokens 25 and 26 sit in chunk [25, 30); the
    # window (44..47, scored max + 1) fills chunk [45, 48) and lifts [40, 45). A
    # budget of 15 buys 3 chunks: those three, the same for both heads.
    assert kept[0] == kept[1] == list(range(25, 30)) + list(range(40, 48))

  def test_sentencekv_keeps_whole_sentences_then_fills_the_budget(self):
    window = 4
    q, k = _attending([[12], [12]], window, strength=4.0)
    tokens = np.full((1, T), 7)
    tokens[0, [9, 15, 30]] = 1  # sentences: [0, 9], [10, 15], [16, 30], [31, 47]
    policy = policies.get("sentencekv", window=window, kernel=1, delimiter_ids=(1,))
    budget = window + 6 + 3
    kept = _kept(policy, budget, q, k, prompt=_prompt(tokens=tokens))[0]
    for h in range(K):
      assert set(range(10, 16)) <= set(kept[h])  # the sentence holding token 12, whole
      assert set(range(T - window, T)) <= set(kept[h])
      assert len(kept[h]) == budget

  def test_ragged_batch_respects_each_length(self):
    q, k = _attending([[5], [6]], 4)
    q2 = jnp.concatenate([q, q], axis=0)
    k2 = jnp.concatenate([k, k], axis=0)
    prompt = _prompt((T, 30))
    for name in ("snapkv", "knorm", "streaming_llm", "h2o", "chunkkv"):
      fields = {} if name in ("knorm",) else (
          {"n_sink": 4} if name == "streaming_llm" else
          {"recent": 4} if name == "h2o" else {"window": 4})
      kept = _kept(policies.get(name, **fields), 12, q2, k2, prompt=prompt)
      for h in range(K):
        assert max(kept[1][h]) < 30, name
        if name != "chunkkv":  # both lengths exceed the budget: exactly the budget
          assert len(kept[0][h]) == len(kept[1][h]) == 12, name
          continue
        for row, n in zip((kept[0][h], kept[1][h]), (T, 30)):
          # Whole chunks of 20 from position 0 (the last one cut at the length), within
          # the budget.
          chunks = sorted({p // 20 for p in row})
          assert row == [p for c in chunks for p in range(c * 20, min(c * 20 + 20, n))], row
          assert len(row) <= 12


class _Tokenizer:
  """Decodes id i to TEXTS[i] (what delimiter_ids reads)."""

  TEXTS = ("the", " cat", ".", ". ", ",", " (x", "\n", "。", "a.b")
  vocab_size = len(TEXTS)

  def decode(self, ids, skip_special_tokens=True):
    return "".join(self.TEXTS[i] for i in ids)


class TestSharedStages:

  def test_delimiter_ids_from_token_text(self):
    tok = _Tokenizer()
    # Ends with (trailing spaces ignored) a sentence end / a clause end; contains one.
    assert delimiters.delimiter_ids(tok) == (2, 3, 6, 7)
    assert delimiters.delimiter_ids(tok, delimiters.CLAUSE_END) == (2, 3, 4, 6, 7)
    assert delimiters.delimiter_ids(tok, (".", "("), anywhere=True) == (2, 3, 5, 8)
    assert policies.delimiter_ids is delimiters.delimiter_ids
    # Policies take their own rule from the tokenizer when they have no ids.
    assert policies.get("sentencekv").bind(tok).delimiter_ids == (2, 3, 6, 7)
    assert policies.get("sablock").bind(tok).delimiter_ids == (2, 3, 4, 6, 7)
    assert policies.get("dynsplit_kv").bind(tok).delimiter_ids == (2, 3, 4, 5, 6, 7, 8)
    assert policies.get("sablock", delimiter_ids=[9]).bind(tok).delimiter_ids == (9,)

  def test_a_policy_without_delimiters_says_so(self):
    with pytest.raises(ValueError, match="sentencekv needs delimiter_ids"):
      policies.get("sentencekv").is_delimiter(jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="sablock needs delimiter_ids"):
      policies.get("sablock", delimiter_ids=(1,)).is_delimiter(None)
    chex.assert_trees_all_equal(
        policies.get("sablock", delimiter_ids=(1, 3)).is_delimiter(jnp.asarray([[0, 1, 2, 3]])),
        jnp.asarray([[False, True, False, True]]))

  def test_segments(self):
    cut = jnp.asarray([[0, 0, 1, 0, 1, 1, 0, 0]], bool)
    seg = selection.segment_ids(cut)
    chex.assert_trees_all_equal(seg, jnp.asarray([[0, 0, 0, 1, 1, 2, 3, 3]], jnp.int32))
    chex.assert_trees_all_equal(selection.segment_starts(seg),
                                jnp.asarray([[0, 0, 0, 3, 3, 5, 6, 6]], jnp.int32))
    scores = jnp.arange(16, dtype=jnp.float32).reshape(1, 2, 8)
    valid = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0]], bool)
    mean = selection.segment_mean(scores, seg, valid)
    chex.assert_shape(mean, (1, 2, 8))
    inf = float("inf")
    chex.assert_trees_all_close(mean, jnp.asarray([[[1, 1, 1, 3.5, 3.5, 5, -inf, -inf],
                                                    [9, 9, 9, 11.5, 11.5, 13, -inf, -inf]]]))
    chex.assert_trees_all_equal(selection.per_segment_sum(valid.astype(jnp.int32), seg)[:, :4],
                                jnp.asarray([[3, 2, 1, 0]], jnp.int32))

  def test_keep_whole_takes_the_best_units_until_one_overflows(self):
    nan, inf = float("nan"), float("inf")
    scores = jnp.asarray([[[3.0, nan, 2.0, 1.0, -inf],
                           [1.0, 2.0, 3.0, 4.0, 5.0]]])
    sizes = jnp.asarray([[5, 1, 3, 1, 1]])
    keep = selection.keep_whole(scores, sizes, 7)
    # Head 0: unit 0 (5) fits, unit 2 (5 + 3) does not, and the greedy run stops
    # there: unit 3 (1) would fit but comes later. NaN and -inf are never chosen.
    # Head 1, best first: 4, 3, 2 (1 + 1 + 3 = 5); unit 1 would make 6, unit 0 11.
    chex.assert_trees_all_equal(keep, jnp.asarray([[[True, False, False, False, False],
                                                    [False, True, True, True, True]]]))

  def test_prefix_scores_are_snapkvs_on_the_prefix(self):
    q, k = _attending([[5, 17], [30, 2]], 8)
    lengths = jnp.asarray([T - 3], jnp.int32)
    scorer = scoring.WindowScorer(8, 5, "mean")
    scores, density = scorer.prefix_scores(EX, q, k, lengths)
    chex.assert_shape(scores, (1, K, T))
    chex.assert_shape(density, (1, T))
    prefix, window = selection.regions(lengths, T, 8)
    assert int(prefix.sum()) == T - 11 and int(window.sum()) == 8
    full = scorer.scores(EX, q, k, lengths)
    chex.assert_trees_all_close(scores, jnp.where(prefix[:, None], full, 0.0), rtol=1e-5,
                                atol=1e-7)
    # The window scores above every prefix token; padding -inf.
    assert float(full[0, :, T - 11:T - 3].min()) > float(full[0, :, :T - 11].max())
    assert np.isneginf(np.asarray(full[0, :, T - 3:])).all()
    # The density is the unpooled attention: highest on the attended tokens.
    assert set(np.argsort(np.asarray(density[0]))[-4:].tolist()) == {2, 5, 17, 30}


class TestBudgets:

  def test_pyramidkv_layer_budgets_follow_kvpress(self):
    # kvpress PyramidKVPress.get_layer_budget for q_len 1024, 50% compression, 30 layers.
    budgets = policies.get("pyramidkv").layer_budgets(512, 1024, 30)
    assert budgets[:4] == (960, 929, 898, 867)
    assert budgets[-3:] == (126, 95, 64)
    # An arithmetic sequence from 960 to 64 averages the budget; each layer's is rounded.
    assert abs(sum(budgets) - 30 * 512) <= 30 * 0.5
    # Too tight for a pyramid above the window: every layer gets the budget.
    assert policies.get("pyramidkv").layer_budgets(100, 1024, 30) == (100,) * 30

  def test_allocated_bytes_follow_the_budgets(self, smollm2_lm):
    cfg = smollm2_lm.config
    ids = smollm2_lm.tokenizer.encode("The grass is green. " * 80)[:400]
    per_slot = cfg.num_kv_heads * cfg.head_dim * 4 * 2  # K heads, float32, keys + values
    for name, budget in (("snapkv", 128), ("pyramidkv", 160), ("streaming_llm", 96)):
      policy = policies.get(name)
      r = kvjax.generate(smollm2_lm, [ids], policy=policy, budget=budget, max_new_tokens=4,
                         stop_ids=[], pad_multiple=16)
      budgets = testing.layout_for(policy, budget, 400, num_layers=cfg.num_layers).budgets
      grow = 0 if policy.evicts_during_decode else 4
      slots = sum(round_up(b + grow, 16) for b in budgets)
      assert r.stats.kv_bytes == slots * per_slot, name
      kept = np.asarray(r.cache.lengths[0, :, 0])
      assert kept.tolist() == [min(b, 400) + (0 if policy.evicts_during_decode else 3)
                               for b in budgets], name


@pytest.mark.slow  # 256 decode steps of SmolLM2 per policy
@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_decode_eviction_holds_the_budget_for_256_tokens(smollm2_lm, name):
  tok = smollm2_lm.tokenizer
  prompt = kvjax.tasks.passkey_prompt(tok, context_tokens=1024, seed=4).prompt
  budget = 128
  r = kvjax.generate(smollm2_lm, [prompt], policy=name, budget=budget, max_new_tokens=256,
                     stop_ids=[])
  assert r.stats.decode_steps == 255
  cfg = smollm2_lm.config
  # The pool never had room for more than the budget.
  assert r.stats.kv_bytes == cfg.num_layers * cfg.num_kv_heads * budget * cfg.head_dim * 4 * 2
  np.testing.assert_array_equal(r.cache.lengths, budget)
  kept = np.asarray(r.cache.kept_positions())[0]  # [L, K, S]
  last = r.stats.prompt_tokens[0] + 255 - 1  # position of the last appended token
  assert (kept.max(-1) == last).all()  # eviction made room: the newest token is there
  for l in range(cfg.num_layers):
    for h in range(cfg.num_kv_heads):
      assert len(set(kept[l, h].tolist())) == budget  # no duplicates, no holes
  if name == "streaming_llm":
    expected = list(range(4)) + list(range(last - budget + 5, last + 1))
    assert sorted(kept[0, 0].tolist()) == expected


def test_register_makes_a_policy_selectable_by_name():
  from typing import ClassVar

  @policies.register
  @dataclasses.dataclass(frozen=True)
  class Newest(policies.Policy):
    name: ClassVar[str] = "test_newest"
    weight: float = 1.0

    def score(self, prompt, q, k, v):
      return jnp.broadcast_to(prompt.positions[:, None, :] * self.weight,
                              (k.shape[0], k.shape[2], k.shape[1])).astype(jnp.float32)

  try:
    assert "test_newest" in policies.names()
    assert policies.get("test_newest", weight=2.0) == Newest(weight=2.0)
    with pytest.raises(ValueError, match="'snapkv' is a built-in policy"):
      policies.register(type("SnapKV2", (policies.SnapKV,), {}))
    with pytest.raises(ValueError, match="register takes a Policy dataclass"):
      policies.register(int)
  finally:
    policies._REGISTRY.pop("test_newest", None)
  assert "test_newest" not in policies.names()


def test_the_command_lines_spelling_is_answered_with_the_python_one():
  with pytest.raises(ValueError, match=r"'adakv:inner=sablock' is the command lines' spelling .* "
                                       r"kvjax.policies.get\('adakv', inner='sablock'\)"):
    policies.get("adakv:inner=sablock")
