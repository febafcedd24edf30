"""The decode loop's carry: starting, stepping and stopping."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from kvjax.cache.paged import PagedKVCache
from kvjax.generation.state import DecodeState

B, M, PAD = 3, 5, 0
STOPS = jnp.array([7, 9], jnp.int32)


def _start(first):
  cache = PagedKVCache.create(batch_size=B, capacity=16, num_layers=2, num_kv_heads=1,
                              head_dim=4, page_size=8)
  return DecodeState.start(jnp.asarray(first, jnp.int32), cache, jax.random.key(0),
                           max_new_tokens=M, pad_id=jnp.int32(PAD), stops=STOPS)


class DecodeStateTest(chex.TestCase):

  def test_start_holds_the_first_token(self):
    state = _start([4, 9, 5])
    chex.assert_shape(state.tokens, (B, M))
    chex.assert_shape(state.done, (B,))
    chex.assert_shape(state.step, ())
    np.testing.assert_array_equal(state.tokens, [[4, 0, 0, 0, 0], [9, 0, 0, 0, 0],
                                                 [5, 0, 0, 0, 0]])
    np.testing.assert_array_equal(state.done, [False, True, False])  # 9 is a stop id
    np.testing.assert_array_equal(state.last(), [4, 9, 5])
    self.assertTrue(state.running())

  def test_advance_writes_pad_after_a_stop(self):
    state = _start([4, 9, 5])
    cache, rng = state.cache, state.rng
    state = state.advance(jnp.array([7, 3, 6]), cache, rng, pad_id=jnp.int32(PAD), stops=STOPS)
    self.assertEqual(int(state.step), 2)
    np.testing.assert_array_equal(state.tokens[:, 1], [7, PAD, 6])
    np.testing.assert_array_equal(state.done, [True, True, False])
    np.testing.assert_array_equal(state.last(), [7, PAD, 6])
    self.assertTrue(state.running())
    state = state.advance(jnp.array([2, 2, 9]), cache, rng, pad_id=jnp.int32(PAD), stops=STOPS)
    self.assertFalse(state.running())  # every sequence has stopped

  def test_runs_as_a_while_loop_carry_until_the_last_token(self):
    def step(state):
      token = state.last() + 1  # never a stop id here
      return state.advance(token, state.cache, state.rng, pad_id=jnp.int32(PAD), stops=STOPS)

    start = _start([0, 10, 20])
    end = jax.jit(lambda s: jax.lax.while_loop(DecodeState.running, step, s))(start)
    self.assertEqual(int(end.step), M)
    np.testing.assert_array_equal(end.tokens, np.arange(M)[None] + np.array([[0], [10], [20]]))
    chex.assert_trees_all_equal(end.cache, start.cache)  # the loop body kept it, bit for bit
    chex.assert_trees_all_equal_shapes_and_dtypes(end, start)


if __name__ == "__main__":
  absltest.main()
