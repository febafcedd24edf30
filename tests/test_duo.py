"""The duo policy: whole prompt in the heads with the highest gates, sinks + recent in the rest."""

import os

import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax.retrieval_heads import save_gates

CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512, tie_embeddings=False,
    rope_theta=500.0)
GATES = np.array([[0.9, 0.1], [0.2, 0.95]], np.float32)  # [L, K]


@pytest.fixture(scope="module")
def gates_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("duo") / "gates"
  save_gates(path, GATES, model="tiny", n_sink=4, recent=28, steps=1, losses=[0.0])
  return str(path)


def test_head_budgets_by_hand(gates_dir):
  duo = policies.get("duo", gates=gates_dir, recent=28)
  sized = dict(page_size=16, grow=16)
  # Streaming share 4 + 28 = 32 (3 pages with the 16 new tokens); 4 heads x 5 pages at
  # budget 64: 8 pages left, all to the highest gate (layer 1, head 1), short of the
  # 17 pages of the whole 256-token prompt.
  np.testing.assert_array_equal(duo.head_budgets(64, 256, 2, 2, **sized), [[32, 32], [32, 160]])
  # At budget 256 every head holds the whole prompt.
  np.testing.assert_array_equal(duo.head_budgets(256, 256, 2, 2, **sized), [[256] * 2] * 2)
  # At budget 128 (9 pages a head): 24 pages left, 14 to the first head, 10 to the next.
  np.testing.assert_array_equal(duo.head_budgets(128, 256, 2, 2, **sized), [[192, 32], [32, 256]])
  layout = duo.layout(128, prompt_len=256, extra_tokens=0, max_new_tokens=16, page_size=16,
                      num_kv_heads=2, windows=(0, 0))
  capacity = layout.capacity
  assert capacity == ((208, 48), (48, 272)) and layout.pages is None and layout.per_head
  assert sum(map(sum, capacity)) == 4 * 144  # what every head at 128 (+16) holds


def test_generate_keeps_the_whole_prompt_in_the_retrieval_head(gates_dir):
  lm = kvjax.init_random(CONFIG, seed=0)
  prompt = np.random.default_rng(0).integers(0, 97, 200).tolist()
  duo = policies.get("duo", gates=gates_dir, recent=28)
  kw = dict(budget=64, max_new_tokens=16, stop_ids=[], page_size=16)
  result = kvjax.generate(lm, [prompt], policy=duo, **kw)
  snap = kvjax.generate(lm, [prompt], policy=policies.get("snapkv", window=16), **kw)
  assert result.cache.kv_bytes == snap.cache.kv_bytes
  kept = np.asarray(result.cache.kept_positions())[0]  # [L, K, S]
  prompt_kept = [[sorted(p for p in kept[l, h] if 0 <= p < 200) for h in range(2)]
                 for l in range(2)]
  # 8 pages beyond the streaming shares: 128 entries more in layer 1, head 1 (160 in all).
  assert prompt_kept[1][1] == list(range(4)) + list(range(200 - 156, 200))
  for l, h in [(0, 0), (0, 1), (1, 0)]:
    assert prompt_kept[l][h] == list(range(4)) + list(range(200 - 28, 200))


def test_refusals(gates_dir):
  lm = kvjax.init_random(CONFIG, seed=0)
  with pytest.raises(ValueError, match="gates .* are for 2 layers x 2 KV heads"):
    policies.get("duo", gates=gates_dir).gate_table(3, 2)
  with pytest.raises(ValueError, match="cannot compress a chunked prefill"):
    kvjax.generate(lm, [[1] * 64], policy=policies.get("duo", gates=gates_dir), budget=48,
                   max_new_tokens=2, prefill_chunk=32)
  with pytest.raises(ValueError, match="gates must be"):
    policies.get("duo", gates="")
  # A path that does not exist is named as a missing folder, not as an unknown model.
  missing = os.path.join(os.path.dirname(gates_dir), "no", "gates")
  with pytest.raises(ValueError, match=f"no gates at {missing}: the folder does not exist"):
    policies.get("duo", gates=missing).gate_table(2, 2)
  with pytest.raises(ValueError, match="kvjax ships no retrieval-head gates for 'no-such-model'"):
    policies.get("duo", gates="no-such-model").gate_table(2, 2)
