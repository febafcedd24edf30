"""DynSplit-KV: boundaries where density drops, the s + C fallback, block selection, exactly B."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import Prompt

DELIM = 1
T, K, G, H = 64, 2, 3, 8
EX = execution.Execution()


def _layout(budget, layers=1):
  """Every one of ``layers`` layers keeps ``budget`` (DynSplit-KV's layout)."""
  return testing.layout_for(_policy(), budget, T, num_layers=layers)


def _prompt(tokens):
  tokens = jnp.asarray(tokens, jnp.int32)[None]
  t = tokens.shape[1]
  return Prompt(tokens, jnp.arange(t, dtype=jnp.int32)[None], jnp.asarray([t], jnp.int32))


def _policy(**kw):
  return policies.get("dynsplit_kv", **{"window": 8, "kernel": 1, "chunk": 8, "delta": 3,
                                        "delimiter_ids": (DELIM,), **kw})


def _attending(targets, window=8, t=T):
  """q, k where the window's queries of every head attend to `targets`."""
  rng = np.random.default_rng(0)
  q = rng.normal(size=(1, t, K * G, H)).astype(np.float32) * 0.1
  k = rng.normal(size=(1, t, K, H)).astype(np.float32) * 0.1
  k[0, targets, :, 0] = 6.0
  q[0, t - window:, :, 0] = 1.0
  return jnp.asarray(q), jnp.asarray(k)


def test_cuts_where_attention_density_drops():
  # The window attends to tokens 13-17 and every token is a candidate: whatever
  # the first block, the block that holds them ends right after 17, where the
  # density drops.
  q, k = _attending(list(range(13, 18)))
  plan = _policy(delimiter_ids=tuple(range(0, 60))).plan(EX,
      _prompt(np.arange(T) % 50), q, k, 24, 24)
  starts, sizes = np.asarray(plan.starts[0]), np.asarray(plan.sizes[0])
  ends = (starts + sizes)[sizes > 0].tolist()
  assert 18 in ends
  # The block holding the attended tokens has the top score in both heads.
  j = ends.index(18)
  assert (np.argmax(np.asarray(plan.block_scores[0]), -1) == j).all()


def test_falls_back_to_s_plus_c_without_candidates():
  q, k = _attending([20])
  plan = _policy().plan(EX, _prompt(np.full(T, 7)), q, k, 24, 24)
  nb = T // (8 - 3) + 1  # T // (C - D) + 1 tiles
  chex.assert_shape([plan.starts, plan.sizes], (1, nb))
  chex.assert_shape(plan.block_scores, (1, K, nb))
  chex.assert_shape(plan.keep, (1, K, T))
  sizes = np.asarray(plan.sizes[0])
  # 56 compressible tokens: blocks of C = 8 from 0 (after 48, 8 <= C + D remain).
  assert sizes[sizes > 0].tolist() == [8] * 7
  assert np.asarray(plan.starts[0])[:7].tolist() == list(range(0, 56, 8))


def test_keeps_whole_blocks_then_exactly_the_budget():
  q, k = _attending([20, 21])
  plan = _policy().plan(EX, _prompt(np.full(T, 7)), q, k, 8 + 8 + 3, 19)
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert set(range(16, 24)) <= set(kept)  # the block [16, 24) holding 20 and 21, whole
  assert set(range(T - 8, T)) <= set(kept)  # the window
  np.testing.assert_array_equal(np.asarray(plan.keep).sum(-1), 19)


def _ends(starts, sizes):
  starts, sizes = np.asarray(starts[0]), np.asarray(sizes[0])
  return (starts + sizes)[sizes > 0].tolist()


def test_a_shared_split_gives_every_layer_the_split_of_the_mean_density():
  # Layer 0's window attends to tokens 13-17, layer 1's to 35-39; every token is
  # a candidate. Alone, each layer cuts after its own run (18, 40); shared, both
  # take the split of the two layers' mean density.
  policy = _policy(delimiter_ids=tuple(range(0, 60)))
  prompt = _prompt(np.arange(T) % 50)
  (q0, k0), (q1, k1) = _attending(list(range(13, 18))), _attending(list(range(35, 40)))
  dens = [policy.scorer.prefix_scores(EX, q, k, prompt.lengths)[1] for q, k in ((q0, k0), (q1, k1))]
  own = [_ends(*policy.split(EX, prompt, d)) for d in dens]
  assert own == [[11, 18, 29, 40, 51, 56], [11, 22, 33, 40, 51, 56]]

  shared = dataclasses.replace(policy, shared_split=True)
  assert shared.needs_every_layer and not policy.needs_every_layer
  recorded = (jnp.stack([q0, q1]), jnp.stack([k0, k1]), jnp.stack([k0, k1]))
  select = shared.select_recorded(EX, _layout(24, 2), prompt, recorded)
  starts, sizes = policy.split(EX, prompt, (dens[0] + dens[1]) / 2)
  assert _ends(starts, sizes) not in own
  changed = []
  for layer, (q, k) in enumerate(((q0, k0), (q1, k1))):
    slots, _ = select(layer, prompt, q, k, k)
    scores = policy.scorer.prefix_scores(EX, q, k, prompt.lengths)[0]
    want = policy.plan_from_blocks(scores, starts, sizes, prompt, 24, 24).keep
    np.testing.assert_array_equal(np.asarray(slots) >= 0, want)
    np.testing.assert_array_equal((np.asarray(slots) >= 0).sum(-1), 24)
    alone = policy.select(EX, _layout(24, 2))(layer, prompt, q, k, k)[0]
    changed.append(bool((np.asarray(alone) != np.asarray(slots)).any()))
  assert any(changed)
  # Per layer, select_recorded is select.
  layout = _layout(24, 2)
  slots, _ = policy.select_recorded(EX, layout, prompt, recorded)(1, prompt, q1, k1, k1)
  np.testing.assert_array_equal(slots, policy.select(EX, layout)(1, prompt, q1, k1, k1)[0])
  with pytest.raises(ValueError, match="needs them all first"):
    shared.select(EX, _layout(24))


def _random_inputs(seed, t=96):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(1, t, K * G, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, t, K, H)), jnp.float32)
  tokens = rng.integers(2, 50, size=t)
  tokens[rng.random(t) < 0.2] = DELIM
  return q, k, _prompt(tokens)


@pytest.mark.parametrize("budget", [12, 60])
def test_exactly_the_budget_per_head_and_one_compile_per_budget(budget):
  policy = _policy()
  select = jax.jit(lambda q, k, prompt: policy.select(EX, _layout(budget))(0, prompt, q, k, k)[0])
  inputs = [_random_inputs(seed) for seed in range(2)]
  with testing.count_compilations() as n:
    outs = [select(*x) for x in inputs]
  assert n[0] == 1
  for slots in map(np.asarray, outs):
    np.testing.assert_array_equal((slots >= 0).sum(-1), budget)
    assert (slots[..., -8:] >= 0).all()


def test_candidates_come_from_token_text(smollm2_lm):
  tok = smollm2_lm.tokenizer
  policy = policies.get("dynsplit_kv").bind(tok)
  for text in (",", ".", "\n", "}", ");", " {"):
    ids = tok.encode(text)
    assert all(i in policy.delimiter_ids for i in ids), text
  assert not any(i in policy.delimiter_ids for i in tok.encode(" the cat sat"))


def test_bad_fields():
  with pytest.raises(ValueError, match="delta 8 must be below chunk 8"):
    policies.get("dynsplit_kv", chunk=8, delta=8)
  with pytest.raises(ValueError, match="shared_split must be a bool"):
    policies.get("dynsplit_kv", shared_split=1)
  with pytest.raises(ValueError, match="alpha must be a finite number"):
    policies.get("dynsplit_kv", alpha=float("nan"))
  q, k, prompt = _random_inputs(0)
  with pytest.raises(ValueError, match="needs delimiter_ids"):
    policies.get("dynsplit_kv").select(EX, _layout(20))(0, prompt, q, k, k)
