"""Decode steps in blocks (one host round trip per block on a GPU): the same tokens and cache."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax.generation import programs

TINY = kvjax.LlamaConfig(
    vocab_size=211, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=1024, tie_embeddings=False,
    rope_theta=1e4)


@pytest.fixture(scope="module")
def tiny():
  return kvjax.init_random(TINY, seed=3)


@pytest.mark.parametrize("name,budget", [
    ("full", None), ("snapkv", 48), ("h2o", 48), ("paged_eviction", 48), ("streaming_llm", 40)])
def test_blocks_give_the_tokens_and_kept_positions_of_single_steps(tiny, name, budget):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(10, TINY.vocab_size, n).tolist() for n in (70, 130)]
  # A stop id the first row meets early: the other row runs on, the first is padded.
  fields = policies.window_fields(name, 16)
  if name == "paged_eviction":
    fields["page_size"] = 8
  kw = dict(policy=policies.get(name, **fields), budget=budget,
            max_new_tokens=12, page_size=8, backend="xla")
  probe = kvjax.generate(tiny, prompts, stop_ids=[], **kw)
  stop = probe.token_ids[0][3]
  one = kvjax.generate(tiny, prompts, stop_ids=[stop], decode_block=1, **kw)
  assert len(one.token_ids[0]) < 12 <= len(probe.token_ids[1])
  for block in (4, 8):
    blocked = kvjax.generate(tiny, prompts, stop_ids=[stop], decode_block=block, **kw)
    assert blocked.token_ids == one.token_ids, (name, block)
    np.testing.assert_array_equal(blocked.cache.kept_positions(), one.cache.kept_positions())
    np.testing.assert_array_equal(blocked.cache.lengths, one.cache.lengths)
    np.testing.assert_array_equal(blocked.cache.scores, one.cache.scores)  # H2O's sums
    assert int(blocked.cache.num_free) == int(one.cache.num_free)


def test_the_block_evens_out_and_is_one_off_a_gpu():
  assert programs.decode_block("cpu", 64) == programs.decode_block("tpu", 64) == 1
  assert programs.decode_block("gpu", 64) == 8  # 63 steps: 8 blocks of 8, one wasted
  assert programs.decode_block("gpu", 12) == 6  # 11 steps: 2 of 6, not 2 of 8
  assert programs.decode_block("gpu", 2) == 1 and programs.decode_block("cpu", 12, 4) == 4


def test_a_bad_block_is_refused(tiny):
  with pytest.raises(ValueError, match="decode_block"):
    kvjax.generate(tiny, [[11, 12, 13]], max_new_tokens=4, decode_block=0)
