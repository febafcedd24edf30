"""The decode loop's samplers: greedy, temperature and top-k, and generate's mapping to them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from kvjax import testing
from kvjax.generation import sampling

B, V = 4, 50


def _logits(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, V)) * 3.0


class SamplerTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_is_argmax(self):
    logits = _logits()
    tokens = self.variant(lambda l, key: sampling.Greedy()(l, key))(logits, jax.random.key(1))
    chex.assert_shape(tokens, (B,))
    chex.assert_type(tokens, jnp.int32)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))

  @chex.variants(with_jit=True, without_jit=True)
  def test_temperature_zero_is_greedy_for_any_key(self):
    logits = _logits()
    for sampler in (sampling.Temperature(jnp.float32(0.0)),
                    sampling.TopK(jnp.float32(0.0), k=5)):
      draw = self.variant(lambda s, key: s(logits, key))
      for seed in range(4):
        np.testing.assert_array_equal(draw(sampler, jax.random.key(seed)), np.argmax(logits, -1))

  @chex.variants(with_jit=True, without_jit=True)
  def test_temperature_draws_from_the_scaled_logits(self):
    logits, key = _logits(), jax.random.key(7)
    got = self.variant(lambda s, key: s(logits, key))(sampling.Temperature(jnp.float32(2.0)), key)
    np.testing.assert_array_equal(got, jax.random.categorical(key, logits / 2.0))

  def test_top_k_never_picks_outside_the_k_most_likely(self):
    logits, k = _logits(), 3
    # A high temperature flattens the distribution: unmasked, most draws would land outside.
    sampler = sampling.TopK(jnp.float32(100.0), k=k)
    keys = jax.random.split(jax.random.key(0), 256)
    draws = np.asarray(jax.jit(jax.vmap(lambda key: sampler(logits, key)))(keys))  # [256, B]
    top = np.argsort(-np.asarray(logits), -1)[:, :k]  # [B, k]
    for row in range(B):
      self.assertContainsSubset(set(draws[:, row].tolist()), set(top[row].tolist()))
      self.assertLen(set(draws[:, row].tolist()), k)  # and it does draw among them

  def test_from_options_maps_generate_arguments(self):
    greedy = sampling.from_options(0.0, 0)
    self.assertIsInstance(greedy, sampling.Temperature)
    chex.assert_trees_all_close(greedy.temperature, jnp.float32(0.0))
    top = sampling.from_options(0.7, 5)
    self.assertIsInstance(top, sampling.TopK)
    self.assertEqual(top.k, 5)
    chex.assert_trees_all_close(top.temperature, jnp.float32(0.7))

  def test_one_program_serves_every_temperature(self):
    # The temperature is a leaf (traced); k is in the tree structure (static).
    draw = jax.jit(lambda s, logits, key: s(logits, key))
    logits, key = _logits(), jax.random.key(0)
    draw(sampling.from_options(1.0, 4), logits, key)
    with testing.count_compilations() as compiled:
      for temperature in (0.0, 0.3, 2.0):
        draw(sampling.from_options(temperature, 4), logits, key)
    self.assertEqual(compiled[0], 0)
    self.assertNotEqual(jax.tree.structure(sampling.from_options(1.0, 4)),
                        jax.tree.structure(sampling.from_options(1.0, 5)))


if __name__ == "__main__":
  absltest.main()
