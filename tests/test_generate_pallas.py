"""kvjax.generate on SmolLM2 with backend "pallas" (kernels interpreted on CPU) gives the
greedy tokens of backend "xla", for a 512-token prompt.

SnapKV exercises the window-scoring kernel at prefill (it picks which prompt
entries each head keeps) and paged decode attention at every decode step;
KNorm the key-norm kernel.
"""

from unittest import mock

import numpy as np
import pytest

import kvjax
from kvjax import backend as backend_lib

_TEXT = (
    "Glaciers form where more snow falls in winter than melts in summer. Over {n} years the "
    "snow compacts into firn and then into dense blue ice, which flows slowly downhill under "
    "its own weight. Station {n} recorded a surface speed of {m} metres per year. "
)


def _prompt(lm, num_tokens):
  text = "".join(_TEXT.format(n=i * 7 + 3, m=i * 13 % 97) for i in range(80))
  ids = lm.tokenizer.encode(text)
  assert len(ids) >= num_tokens
  return ids[:num_tokens]


@pytest.mark.parametrize("policy, budget, scoring_kernel", [
    ("snapkv", 128, "window_scores"),
    ("knorm", 128, "token_norms"),
])
def test_pallas_matches_xla_greedy_tokens(smollm2_lm, policy, budget, scoring_kernel):
  prompt = _prompt(smollm2_lm, 512)
  kwargs = dict(policy=policy, budget=budget, max_new_tokens=8, stop_ids=[])
  xla = kvjax.generate(smollm2_lm, [prompt], backend="xla", **kwargs)
  with mock.patch.object(backend_lib, scoring_kernel,
                         wraps=getattr(backend_lib, scoring_kernel)) as scores, \
       mock.patch.object(backend_lib, "paged_attention",
                         wraps=backend_lib.paged_attention) as attention:
    pallas = kvjax.generate(smollm2_lm, [prompt], backend="pallas", **kwargs)
  # The Pallas kernels were traced into the programs (the layers are a scan: once).
  assert scores.call_count >= 1
  assert attention.call_count >= 1
  assert pallas.stats.backend == "pallas"
  assert pallas.token_ids == xla.token_ids
  kept_pallas = np.asarray(pallas.cache.kept_positions())
  kept_xla = np.asarray(xla.cache.kept_positions())
  for kept in (kept_pallas, kept_xla):  # every head: the budget, then the 7 decoded tokens
    np.testing.assert_array_equal((kept >= 0).sum(-1), budget + 7)
    np.testing.assert_array_equal((kept >= 512).sum(-1), 7)
  if policy == "snapkv":
    # The same entries were kept: the selection did not move either.
    np.testing.assert_array_equal(kept_pallas, kept_xla)
  else:
    # Key norms are RoPE-invariant, so repeated tokens tie exactly in early layers,
    # and a last-bit difference in summation order picks among equals: nearly the
    # same entries.
    assert (kept_pallas == kept_xla).mean() > 0.95


@pytest.mark.parametrize("policy, op", [("sablock", "segment_ids"),
                                        ("dynsplit_kv", "dynamic_split")])
def test_segmentation_kernels_under_backend_pallas(smollm2_lm, policy, op):
  """backend="pallas" routes SABlock's segmentation and DynSplit-KV's boundary walk
  through their Pallas kernels ("auto" keeps them on XLA, see kvjax/backend.py)."""
  prompt = _prompt(smollm2_lm, 384)
  kwargs = dict(policy=policy, budget=96, max_new_tokens=2, stop_ids=[])
  xla = kvjax.generate(smollm2_lm, [prompt], backend="xla", **kwargs)
  with mock.patch.object(backend_lib.segmentation, op,
                         wraps=getattr(backend_lib.segmentation, op)) as kernel:
    pallas = kvjax.generate(smollm2_lm, [prompt], backend="pallas", **kwargs)
  assert kernel.call_count >= 1
  assert backend_lib.resolve("auto", op) == "xla"
  np.testing.assert_array_equal(np.asarray(pallas.cache.kept_positions()),
                                np.asarray(xla.cache.kept_positions()))
  assert pallas.token_ids == xla.token_ids
