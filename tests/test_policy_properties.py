"""Property tests of the policies' prefill selection, and the NaN/Inf guard.

Hypothesis draws prompts (random q, k, v, lengths and tokens) at small, fixed
shapes and runs every policy of a fixed menu on each (so each policy compiles
once), checking what ``policy.select(ex, layout)`` returns, in both
layers (PyramidKV's budgets differ per layer):

  - slots are dense: a head's kept tokens fill slots 0..n-1 in their original
    order; padding (t >= length) is never kept;
  - a head keeps at most its layer budget, and exactly min(budget, length)
    where the policy promises it (all but chunkkv, which keeps whole chunks);
  - sinks and the observation window (streaming_llm's recent tokens, h2o's
    recent window) are always kept;
  - chunkkv keeps whole chunks, one index set for every head of a sequence;
  - isolation: replacing another sequence's q/k/v (with NaN, even) never
    changes a sequence's selection.

The NaN/Inf guard (docs/reliability.md): a NaN or Inf key, or a NaN/Inf score
such as ||v|| / ||k|| for a zero-norm key, never makes a policy keep garbage:
NaN and -inf scores are never kept, +inf ranks first, and the promises above
still hold.

Example budget: EXAMPLES (100) prompts per test, each run through all 8 menu
policies in both layers (1,600 selections per test), derandomized so that CI
runs the same cases every time; KVJAX_PROPERTY_EXAMPLES overrides it.
"""

import functools
import os

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import Prompt
from kvjax.policies import selection

EXAMPLES = int(os.environ.get("KVJAX_PROPERTY_EXAMPLES", "100"))
SETTINGS = hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                               database=None, print_blob=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])

B, T, K, G, H, L = 3, 16, 2, 2, 8, 2
EX = execution.Execution()
DELIMITER = 1  # sentencekv's sentence end; tokens are drawn from [0, 4)

# (name, fields, budget): small windows so the budget leaves room for scored tokens.
MENU = (
    ("streaming_llm", dict(n_sink=2), 6),
    ("snapkv", dict(window=3, kernel=3), 7),
    ("snapkv", dict(window=2, kernel=1, group="max"), 5),
    ("pyramidkv", dict(window=2, kernel=1, beta=4), 8),
    ("knorm", {}, 5),
    ("h2o", dict(recent=2), 6),
    ("chunkkv", dict(window=2, kernel=1, chunk_length=3), 7),
    ("sentencekv", dict(window=2, kernel=1, delimiter_ids=(DELIMITER,)), 7),
)
EXACT = ("streaming_llm", "snapkv", "pyramidkv", "knorm", "h2o", "sentencekv")
# Policies whose scores come from the keys (knorm) or the attention over them.
KEY_SCORED = ("snapkv", "pyramidkv", "knorm", "h2o", "chunkkv", "sentencekv")


def _policy(i):
  name, fields, budget = MENU[i]
  policy = policies.get(name, **fields)
  return policy, budget, _layout(policy, budget).budgets


def _layout(policy, budget):
  return testing.layout_for(policy, budget, T, num_layers=L, num_kv_heads=K)


def _select(i, layer, prompt, q, k, v):
  """(slots [B, K, T], scores or None) as numpy, through one compiled program per policy."""
  policy, budget, _ = _policy(i)
  slots, scores = _compiled_select(policy, _layout(policy, budget), layer, prompt, q, k, v)
  return np.asarray(slots), scores


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled_select(policy, layout, layer, prompt, q, k, v):
  return policy.select(EX, layout)(layer, prompt, q, k, v)


def forced(name, fields, budget, length):
  """Positions a policy must keep for a prompt of ``length`` tokens (its sinks and window)."""
  if name == "streaming_llm":
    recent = budget - fields["n_sink"]
    return set(range(min(fields["n_sink"], length))) | set(range(max(length - recent, 0), length))
  window = fields.get("window", fields.get("recent", 0))
  return set(range(max(length - window, 0), length))


def check_selection(i, layer, slots, lengths):
  """Every promise of MENU[i] on slots [B, K, T] for prompts of ``lengths`` tokens."""
  name, fields, _ = MENU[i]
  _, budget, budgets = _policy(i)
  lb = budgets[layer]
  for b, n in enumerate(lengths):
    per_head = []
    for h in range(K):
      row = slots[b, h]
      kept = np.nonzero(row >= 0)[0]
      per_head.append(kept.tolist())
      where = f"{name} {fields} budget {lb}, sequence {b} (length {n}), head {h}"
      # Dense, in original order, never padding.
      np.testing.assert_array_equal(row[kept], np.arange(kept.size), err_msg=where)
      assert kept.size == 0 or kept.max() < n, f"{where}: keeps padding {kept.tolist()}"
      assert kept.size <= lb, f"{where}: keeps {kept.size} > budget"
      if name in EXACT:
        assert kept.size == min(lb, n), f"{where}: keeps {kept.size}, not {min(lb, n)}"
      missing = forced(name, fields, lb, n) - set(kept.tolist())
      if name != "chunkkv":
        assert not missing, f"{where}: sinks/window {sorted(missing)} not kept"
    if name == "chunkkv":
      c = fields["chunk_length"]
      assert all(p == per_head[0] for p in per_head), f"chunkkv heads differ: {per_head}"
      for start in range(0, n, c):
        chunk = set(range(start, min(start + c, n)))
        got = chunk & set(per_head[0])
        assert not got or got == chunk, f"chunkkv splits chunk {sorted(chunk)}: {per_head[0]}"


@st.composite
def prompts(draw):
  """(seed, lengths [B], scale of q/k)."""
  lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
  seed = draw(st.integers(0, 2**31 - 1))
  scale = draw(st.sampled_from([0.1, 1.0, 4.0]))  # flat to peaked attention
  return seed, lengths, scale


def _every_policy_and_layer():
  for i in range(len(MENU)):
    for layer in range(L):
      yield i, layer


def _inputs(seed, lengths, scale):
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((B, T, K * G, H)) * scale).astype(np.float32)
  k = (rng.standard_normal((B, T, K, H)) * scale).astype(np.float32)
  v = rng.standard_normal((B, T, K, H)).astype(np.float32)
  tokens = rng.integers(0, 4, (B, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  prompt = Prompt(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths, jnp.int32))
  return prompt, q, k, v, rng


@SETTINGS
@hypothesis.given(prompts())
def test_selection_keeps_its_promises(case):
  seed, lengths, scale = case
  prompt, q, k, v, _ = _inputs(seed, lengths, scale)
  for i, layer in _every_policy_and_layer():
    slots, _ = _select(i, layer, prompt, q, k, v)
    check_selection(i, layer, slots, lengths)


@SETTINGS
@hypothesis.given(prompts())
def test_other_sequences_never_change_a_selection(case):
  seed, lengths, scale = case
  prompt, q, k, v, rng = _inputs(seed, lengths, scale)
  # Sequence 0 keeps its inputs; the others get new ones, NaN in places.
  q2, k2, v2 = (x.copy() for x in (q, k, v))
  for x in (q2, k2, v2):
    x[1:] = rng.standard_normal(x[1:].shape) * 3
    x[1:, rng.integers(0, T)] = np.nan
  other = prompt._replace(tokens=prompt.tokens.at[1:].set(DELIMITER),
                          lengths=prompt.lengths.at[1:].set(T))
  for i, layer in _every_policy_and_layer():
    slots, scores = _select(i, layer, prompt, q, k, v)
    slots2, scores2 = _select(i, layer, other, q2, k2, v2)
    np.testing.assert_array_equal(slots2[0], slots[0], err_msg=str(MENU[i]))
    if scores is not None:
      np.testing.assert_array_equal(np.asarray(scores2)[0], np.asarray(scores)[0])


@SETTINGS
@hypothesis.given(prompts(), st.sampled_from([np.nan, np.inf, -np.inf]), st.data())
def test_nan_or_inf_keys_never_select_garbage(case, bad, data):
  seed, lengths, scale = case
  prompt, q, k_clean, v, _ = _inputs(seed, lengths, scale)
  t_bad = data.draw(st.integers(0, lengths[0] - 1), label="poisoned token")
  h_bad = data.draw(st.integers(0, K - 1), label="poisoned head")
  k = k_clean.copy()
  k[0, t_bad, h_bad, data.draw(st.integers(0, H - 1), label="poisoned dim")] = bad
  for i, layer in _every_policy_and_layer():
    _check_poisoned(i, layer, prompt, q, k, k_clean, v, lengths, t_bad, h_bad, bad)


def _check_poisoned(i, layer, prompt, q, k, k_clean, v, lengths, t_bad, h_bad, bad):
  """Promises of MENU[i] when key [0, t_bad, h_bad] holds ``bad`` (NaN or +-Inf)."""
  name, fields, _ = MENU[i]
  slots, _ = _select(i, layer, prompt, q, k, v)
  # Promises hold, except exact counts: a head whose scores turned NaN keeps
  # only what it is forced to keep (its sinks and window).
  for b in range(B):
    for h in range(K):
      kept = np.nonzero(slots[b, h] >= 0)[0]
      np.testing.assert_array_equal(slots[b, h, kept], np.arange(kept.size))
      assert kept.size <= _policy(i)[2][layer] and (kept.size == 0 or kept.max() < lengths[b])
  _, budget, budgets = _policy(i)
  if name != "chunkkv":
    for h in range(K):
      missing = forced(name, fields, budgets[layer], lengths[0]) - set(
          np.nonzero(slots[0, h] >= 0)[0].tolist())
      assert not missing, f"{name}: head {h} lost forced tokens {sorted(missing)}"
  # A NaN key makes the token's score NaN (knorm: -||k||; attention: its softmax
  # rows), and an Inf key makes knorm's score -inf: never kept unless forced. (An
  # Inf key under attention scoring may give a finite score, e.g. weight 0.)
  nonfinite_score = np.isnan(bad) or name == "knorm"
  if (name in KEY_SCORED and nonfinite_score
      and t_bad not in forced(name, fields, budgets[layer], lengths[0])):
    heads = range(K) if name == "chunkkv" else [h_bad]
    for h in heads:
      assert slots[0, h, t_bad] < 0, f"{name} kept the token with a {bad} key"
  # Other sequences are untouched: the same selection as without the bad key.
  clean, _ = _select(i, layer, prompt, q, k_clean, v)
  np.testing.assert_array_equal(slots[1:], clean[1:])


@SETTINGS
@hypothesis.given(st.integers(0, 2**31 - 1), st.integers(1, 12),
                  st.lists(st.sampled_from(["finite", "nan", "inf", "-inf"]), min_size=24,
                           max_size=24))
def test_keep_top_ranks_nan_and_inf(seed, budget, kinds):
  # scores [1, 1, 24]: random finite values with NaN / +-inf at drawn places.
  scores = np.random.default_rng(seed).standard_normal(24).astype(np.float32)
  special = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
  for t, kind in enumerate(kinds):
    scores[t] = special.get(kind, scores[t])
  keep = np.asarray(_keep_top(jnp.asarray(scores)[None, None], budget))[0, 0]
  eligible = [t for t in range(24) if kinds[t] in ("finite", "inf")]
  # +inf first, then finite by value; NaN and -inf never.
  order = sorted(eligible, key=lambda t: (kinds[t] != "inf", -scores[t] if kinds[t] == "finite"
                                          else 0.0))
  want = np.zeros(24, bool)
  want[order[:budget]] = True
  np.testing.assert_array_equal(keep, want)


@jax.jit
def _keep_top(scores, budget):
  return selection.keep_top(scores, budget, 12)


def test_value_over_key_norm_with_a_zero_key():
  # ||v|| / ||k||: a zero key with a non-zero value scores +inf (kept first),
  # a zero key with a zero value scores 0 / 0 = NaN (never kept).
  k = np.ones((1, 6, 1, 4), np.float32)
  v = np.ones((1, 6, 1, 4), np.float32)
  k[0, 1] = 0.0  # +inf
  k[0, 4] = 0.0
  v[0, 4] = 0.0  # NaN
  ratio = jnp.linalg.norm(v, axis=-1) / jnp.linalg.norm(k, axis=-1)  # [1, 6, 1]
  scores = jnp.swapaxes(ratio, 1, 2)  # [1, 1, 6]
  assert np.isposinf(scores[0, 0, 1]) and np.isnan(scores[0, 0, 4])
  keep = np.asarray(selection.keep_top(scores, 2, 2))[0, 0]
  assert keep[1] and not keep[4] and keep.sum() == 2
  keep_all_but = np.asarray(selection.keep_top(scores, 6, 6))[0, 0]
  np.testing.assert_array_equal(keep_all_but, [True, True, True, True, False, True])


def test_h2o_decode_eviction_evicts_a_nan_score_first():
  # Decode-time eviction: argmin over the non-recent slots picks a NaN score
  # before any number, so a poisoned entry is the first to go; a recent one never is.
  from kvjax.cache import PagedKVCache
  cache = PagedKVCache.create(batch_size=1, capacity=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, page_size=4)
  cache = cache.reserve(jnp.full((1, 1, 1), 6))
  kv = jnp.zeros((1, 6, 1, 2))
  scores = jnp.array([[[0.5, 0.1, jnp.nan, 0.3, jnp.nan, jnp.nan]]])
  cache = cache.write(0, kv, kv, jnp.arange(6)[None, None], jnp.arange(6)[None], scores)
  cache = cache.set_lengths(0, jnp.array([[6]]))
  h2o = policies.get("h2o", recent=2)  # positions 4 and 5 are recent for position 6
  np.testing.assert_array_equal(h2o.evict_slot(EX, cache, jnp.array([6])), [[[2]]])
  clean = cache.replace(scores=jnp.where(jnp.isnan(cache.scores), 1.0, cache.scores))
  np.testing.assert_array_equal(h2o.evict_slot(EX, clean, jnp.array([6])), [[[1]]])


@pytest.mark.parametrize("i", range(len(MENU)))
def test_menu_policy_is_valid(i):
  # Each menu budget leaves room to choose: above what the policy always keeps,
  # within the prompt; PyramidKV's layers keep L x budget between them, the top
  # layer least.
  name, fields, _ = MENU[i]
  policy, budget, budgets = _policy(i)
  policy.validate(budget)
  assert policy.reserved() == fields.get("n_sink", fields.get("window", fields.get("recent", 0)))
  with pytest.raises(ValueError, match="must exceed|must be a positive int"):
    policy.validate(policy.reserved())
  if name == "pyramidkv":
    # kvpress's pyramid for T=16, window 2, beta 4: the top layer keeps the window alone.
    assert budgets == (14, 2) and sum(budgets) == L * budget
  else:
    assert budgets == (budget,) * L and policy.reserved() < budget <= T
