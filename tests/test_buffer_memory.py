"""The peak of live jax buffers: each buffer once, a program's own allocations, generate's runs."""

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import buffer_memory

# Heads wide enough that the cache, not the attention's scratch, is what grows with the prompt.
CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=128, max_position_embeddings=4096, tie_embeddings=True)


def test_live_bytes_counts_each_buffer_once():
  before = buffer_memory.live_bytes()
  x = jnp.zeros((256, 1024), jnp.float32)  # 1 MiB
  same = [x, x]
  assert buffer_memory.live_bytes() - before == 2**20
  y = x + 1
  assert buffer_memory.live_bytes() - before == 2 * 2**20
  del x, y, same
  assert buffer_memory.live_bytes() == before


def test_running_bytes_counts_new_outputs_not_donated_ones():
  x = jnp.ones((512, 512), jnp.float32)  # 1 MiB
  fresh = jax.jit(lambda a: a * 2).lower(x).compile()
  donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
  assert buffer_memory.running_bytes(fresh) >= x.nbytes
  assert buffer_memory.running_bytes(fresh) - buffer_memory.running_bytes(donated) == x.nbytes


def test_track_keeps_the_largest_total_and_nests():
  small = jnp.ones((16,), jnp.float32)
  program = jax.jit(lambda a: a + 1).lower(small).compile()
  buffer_memory.observe(program, "untracked")  # no tracker: nothing to record, no error
  with buffer_memory.track() as outer:
    buffer_memory.observe(program, "first")
    first = outer.bytes
    assert first == buffer_memory.live_bytes() + buffer_memory.running_bytes(program)
    big = jnp.ones((1024, 1024), jnp.float32)
    with buffer_memory.track() as inner:
      buffer_memory.observe(program, "second")
    del big
    buffer_memory.observe(program, "third")  # less is live now: the peak stays
  assert inner.bytes == outer.bytes == first + 4 * 2**20
  assert outer.program == inner.program == "second"


def test_chunked_prefill_peaks_below_the_full_cache_one_shot():
  """A 2,048-token prompt: the full cache holds it all while the one-shot prefill runs;
  chunks of 128 compressed to 128 entries never hold more than 128 + 128 per head."""
  lm = kvjax.init_random(CONFIG, seed=0)
  prompt = [list(np.random.default_rng(0).integers(1, CONFIG.vocab_size, 2048))]
  # Every live array counts, other tests' too: what is live before a run (the
  # weights among it) is left out.
  before = buffer_memory.live_bytes()
  peaks = {}
  for policy, budget, chunk in (("full", None, 0), ("snapkv", 128, 128)):
    with buffer_memory.track() as peak:
      result = kvjax.generate(lm, prompt, policy=policy, budget=budget, max_new_tokens=4,
                              stop_ids=[], prefill_chunk=chunk)
    # The cache is live while every program runs.
    assert peak.bytes - before >= result.stats.kv_bytes
    peaks[policy] = (peak.bytes - before, peak.program, result.stats.kv_bytes)
    del result
  assert peaks["full"][1] == "prefill" and peaks["snapkv"][1] in ("prefill_chunk", "decode")
  assert peaks["snapkv"][2] < peaks["full"][2] / 6
  assert peaks["snapkv"][0] < peaks["full"][0] / 2
