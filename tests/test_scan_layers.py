"""The two layouts of a model's layers: stacked under lax.scan, or one module each, unrolled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from flax import nnx

import kvjax
from kvjax import policies
from kvjax import testing
from kvjax.generation import compile as compile_lib
from kvjax.models import lm as lm_lib

CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512, tie_embeddings=False,
    rope_theta=500.0)


def _unrolled_twin(lm):
  graphdef, params = lm_lib.build_params(lm.config, lm_lib.canonical_weights(lm),
                                         scan_layers=False)
  return lm_lib.LanguageModel(lm.config, graphdef, params, None, "unrolled")


class ScanLayersTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.scanned = kvjax.init_random(CONFIG, seed=5)
    cls.unrolled = _unrolled_twin(cls.scanned)
    rng = np.random.default_rng(1)
    cls.prompts = [rng.integers(0, 97, n).tolist() for n in (150, 90)]

  def test_layer_i_holds_slice_i_of_the_stacked_weights(self):
    self.assertTrue(self.scanned.scan_layers)
    self.assertFalse(self.unrolled.scan_layers)
    stacked = nnx.to_pure_dict(self.scanned.params)["layers"]
    per_layer = nnx.to_pure_dict(self.unrolled.params)["layers"]
    self.assertLen(per_layer, CONFIG.num_layers)
    for i in range(CONFIG.num_layers):
      np.testing.assert_array_equal(per_layer[i]["w_down"], stacked["w_down"][i])
      np.testing.assert_array_equal(per_layer[i]["attn_norm"]["scale"],
                                    stacked["attn_norm"]["scale"][i])

  def test_same_logits(self):
    tokens = np.array(self.prompts[1][:64])[None]
    testing.assert_close(self.unrolled.forward(tokens), self.scanned.forward(tokens),
                         atol=1e-4, rtol=1e-4)

  @pytest.mark.slow  # compiles every program twice (scanned, unrolled) per policy
  def test_same_tokens_and_kept_entries_under_policies(self):
    # One-shot compression, chunked prefill with compression per chunk,
    # decode-time eviction, and a question appended after compression.
    runs = [
        dict(policy=policies.get("snapkv", window=8), budget=48),
        dict(policy=policies.get("snapkv", window=8), budget=48, prefill_chunk=64),
        dict(policy=policies.get("h2o", recent=8), budget=40),
        dict(policy="full", questions=[[3, 4, 5], [6, 7]], query_aware=False),
    ]
    for kw in runs:
      kw = dict(kw, max_new_tokens=8, stop_ids=[])
      want = kvjax.generate(self.scanned, self.prompts, **kw)
      got = kvjax.generate(self.unrolled, self.prompts, **kw)
      self.assertEqual(got.token_ids, want.token_ids, kw)
      for a, b in zip(got.cache.kept_positions(), want.cache.kept_positions()):
        np.testing.assert_array_equal(a, b)

  def test_unrolled_prefill_needs_no_more_scratch_than_scanned(self):
    # Unrolled, XLA may start every layer's buffers that depend on no input
    # (e.g. zero-filled outputs) at once; the model keeps them per layer.
    def scratch(lm):
      compile_lib._PROGRAMS.clear()
      kvjax.generate(lm, [self.prompts[0] * 2], policy=policies.get("snapkv", window=8),
                     budget=64, max_new_tokens=2, attention_block=32)
      (program,) = [p for key, p in compile_lib._PROGRAMS.items() if key[0] == "prefill"]
      return program.memory_analysis().temp_size_in_bytes

    scanned, unrolled = scratch(self.scanned), scratch(self.unrolled)
    self.assertLess(unrolled, 1.25 * scanned, (unrolled, scanned))

  def test_canonical_weights_are_the_loaders_and_rebuild_both_layouts(self):
    from kvjax.models.gguf_loader import canonical_shapes
    weights = lm_lib.canonical_weights(self.scanned)
    self.assertEqual({k: v.shape for k, v in weights.items()}, canonical_shapes(CONFIG))
    for name, array in lm_lib.canonical_weights(self.unrolled).items():
      np.testing.assert_array_equal(array, weights[name], err_msg=name)
    # q, k, v sit side by side in wqkv, in that order.
    wqkv = nnx.to_pure_dict(self.scanned.params)["layers"]["wqkv"]
    np.testing.assert_array_equal(wqkv[..., 96:128], weights["layers/wk"])
    _, rebuilt = lm_lib.build_params(CONFIG, weights)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(rebuilt),
                 nnx.to_pure_dict(self.scanned.params))

  def test_build_params_names_the_part_of_a_joined_weight(self):
    weights = lm_lib.canonical_weights(self.scanned)
    weights["layers/wk"] = weights["layers/wk"][..., :-1]
    for scan_layers in (True, False):
      with self.assertRaisesRegex(ValueError, r"layers/wk \(8, 64, 31\)"):
        lm_lib.build_params(CONFIG, weights, scan_layers=scan_layers)

  def test_build_params_checks_the_layer_axis(self):
    weights = lm_lib.canonical_weights(self.scanned)
    weights["layers/wq"] = weights["layers/wq"][:2]
    with self.assertRaisesRegex(ValueError, "lead with L=8"):
      lm_lib.build_params(CONFIG, weights, scan_layers=False)


class DefaultLayoutTest(absltest.TestCase):
  """scan_layers=None: unrolled on GPU and TPU (decode steps), scanned on CPU (compile time)."""

  def test_by_platform(self):
    from unittest import mock
    from kvjax.models import llama
    self.assertTrue(llama.default_scan_layers())
    for platform, scanned in (("gpu", False), ("tpu", False), ("cpu", True)):
      with mock.patch.object(jax, "default_backend", return_value=platform):
        self.assertEqual(llama.default_scan_layers(None), scanned, platform)
        self.assertTrue(llama.default_scan_layers(True))
        self.assertFalse(llama.default_scan_layers(False))
      with mock.patch.object(jax, "default_backend", return_value=platform):
        lm = kvjax.init_random(CONFIG)
      self.assertEqual(lm.scan_layers, scanned, platform)


if __name__ == "__main__":
  absltest.main()
