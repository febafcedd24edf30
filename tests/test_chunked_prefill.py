"""Chunked prefill with incremental compression: attention, what is kept, memory, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import execution
from kvjax import generation as generate_lib
from kvjax import policies
from kvjax import testing
from kvjax.cache import attention
from kvjax.cache.paged import PagedKVCache


def _dense_attention(q, k, v):
  """q [C, N, H] against k, v [S, K, H]; every key visible. -> [C, N, H] float32."""
  g = q.shape[1] // k.shape[1]
  k = np.repeat(k, g, axis=1)
  v = np.repeat(v, g, axis=1)
  logits = np.einsum("cnh,snh->ncs", q, k) / np.sqrt(q.shape[-1])
  return np.einsum("ncs,snh->cnh", jax.nn.softmax(logits, -1), v)


@pytest.mark.parametrize("rows", [attention.ATTEND_ROWS, 5])
def test_extend_attention_equals_dense_attention_over_cache_and_chunk(monkeypatch, rows):
  """Two sequences with different cached lengths and chunk lengths, G = 3, and
  NaN in every pool slot no head has filled: each valid chunk query sees its
  head's cached entries and the chunk up to itself, as dense softmax does;
  in one block of query rows, or in blocks of 5 (a padded last block, and
  blocks that start mid-chunk and mid-head)."""
  monkeypatch.setattr(attention, "ATTEND_ROWS", rows)
  rng = np.random.default_rng(1)
  b, c, n, kh, h = 2, 8, 6, 2, 8
  cached, chunk = [13, 5], [8, 3]
  cache = PagedKVCache.create(batch_size=b, capacity=32, num_layers=1, num_kv_heads=kh,
                              head_dim=h, page_size=4)
  cache = cache.replace(k_pages=jnp.full_like(cache.k_pages, jnp.nan),
                        v_pages=jnp.full_like(cache.v_pages, jnp.nan))
  old_k = rng.normal(size=(b, 13, kh, h)).astype(np.float32)
  old_v = rng.normal(size=(b, 13, kh, h)).astype(np.float32)
  cache, _ = attention.extend_attention(
      cache, 0, jnp.zeros((b, 13, n, h)), jnp.asarray(old_k), jnp.asarray(old_v),
      jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (b, 13)), jnp.asarray(cached, jnp.int32))
  q = rng.normal(size=(b, c, n, h)).astype(np.float32)
  k = rng.normal(size=(b, c, kh, h)).astype(np.float32)
  v = rng.normal(size=(b, c, kh, h)).astype(np.float32)
  positions = jnp.asarray(np.array(cached)[:, None] + np.arange(c), jnp.int32)
  cache, out = attention.extend_attention(cache, 0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                          positions, jnp.asarray(chunk, jnp.int32))
  out = np.asarray(out)
  np.testing.assert_array_equal(np.asarray(cache.lengths)[:, 0], [[21, 21], [8, 8]])
  for i in range(b):
    for t in range(chunk[i]):
      keys = np.concatenate([old_k[i, :cached[i]], k[i, :t + 1]])
      values = np.concatenate([old_v[i, :cached[i]], v[i, :t + 1]])
      ref = _dense_attention(q[i, t:t + 1], keys, values)
      np.testing.assert_allclose(out[i, t], ref[0], atol=1e-5)


def test_two_chunks_keep_the_global_top_norms_and_attend_to_what_is_kept():
  """KNorm's score does not depend on context, so compressing chunk by chunk keeps
  exactly the budget of lowest-norm keys over the whole prompt, and chunk 2
  attends to exactly the entries kept after chunk 1 plus itself (causally)."""
  rng = np.random.default_rng(0)
  b, c, n, kh, h, budget = 1, 32, 4, 2, 8, 24
  q = rng.normal(size=(b, 2 * c, n, h)).astype(np.float32)
  k = (rng.normal(size=(b, 2 * c, kh, h)) * rng.uniform(0.2, 3, size=(b, 2 * c, kh, 1))
       ).astype(np.float32)
  v = rng.normal(size=(b, 2 * c, kh, h)).astype(np.float32)
  cache = PagedKVCache.create(batch_size=b, capacity=budget + c, num_layers=1, num_kv_heads=kh,
                              head_dim=h, page_size=8)
  knorm = policies.get("knorm")
  select = knorm.select(execution.Execution(), testing.layout_for(knorm, budget, 2 * c))
  positions = np.arange(2 * c, dtype=np.int32)[None]
  outs = []
  for i in range(2):
    sl = slice(i * c, (i + 1) * c)
    cache, out = attention.chunk_attention(
        cache, 0, jnp.asarray(q[:, sl]), jnp.asarray(k[:, sl]), jnp.asarray(v[:, sl]),
        jnp.asarray(positions[:, sl]), jnp.asarray([c], jnp.int32), select=select)
    testing.assert_cache_consistent(cache)
    if i == 0:
      kept_after_first = np.asarray(cache.kept_positions())[0, 0]  # [K, S]
    outs.append(np.asarray(out))
  kept = np.asarray(cache.kept_positions())[0, 0]
  norms = np.linalg.norm(k[0], axis=-1)  # [T, K]
  for head in range(kh):
    expected = np.sort(np.argsort(norms[:, head], kind="stable")[:budget])
    np.testing.assert_array_equal(kept[head][:budget], expected)  # in position order
    assert (kept[head][budget:] == -1).all()
    # Chunk 2, query t: the entries kept after chunk 1 + chunk-2 tokens up to t.
    old = kept_after_first[head][kept_after_first[head] >= 0]
    g = n // kh
    for t in (0, c - 1):
      visible = np.concatenate([old, np.arange(c, c + t + 1)])
      ref = _dense_attention(q[0, c + t:c + t + 1, head * g:(head + 1) * g],
                             k[0, visible][:, head:head + 1], v[0, visible][:, head:head + 1])
      np.testing.assert_allclose(outs[1][0, t, head * g:(head + 1) * g], ref[0], atol=1e-5)


def test_full_policy_chunked_equals_one_shot(smollm2_lm):
  # The second prompt ends chunks before the first: its next-token logits are
  # those of the chunk holding its last token, carried through the later chunks.
  prompts = [kvjax.tasks.make_sample(smollm2_lm.tokenizer, "niah", length=n, seed=2).prompt
             for n in (600, 300)]
  one = kvjax.generate(smollm2_lm, prompts, max_new_tokens=10)
  chunked = kvjax.generate(smollm2_lm, prompts, max_new_tokens=10, prefill_chunk=128)
  assert chunked.token_ids == one.token_ids
  np.testing.assert_array_equal(chunked.cache.kept_positions(), one.cache.kept_positions())


def test_a_chunked_generate_compiles_its_programs_and_nothing_else(smollm2_lm):
  """Host values reach the device without compiling: an eager jnp op compiles a program
  per shape, which a CPU process then holds (~1.5 MiB each)."""
  compiled = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(kwargs["fun_name"])

  prompt = kvjax.tasks.make_sample(smollm2_lm.tokenizer, "niah", length=333, seed=4).prompt
  kwargs = dict(policy=policies.get("snapkv", window=16), budget=72, max_new_tokens=5,
                prefill_chunk=96)  # shapes no other test uses: nothing compiled yet
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    kvjax.generate(smollm2_lm, [prompt], **kwargs)
    first = list(compiled)
    kvjax.generate(smollm2_lm, [prompt], **kwargs)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert sorted(first) == ["jit(_empty_arrays)", "jit(decode)", "jit(prefill_chunk)"]
  assert compiled == first  # the second call compiled nothing


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming_llm", "paged_eviction"])
def test_chunked_compression_holds_the_budget(smollm2_lm, name):
  tok = smollm2_lm.tokenizer
  prompts = [kvjax.tasks.make_sample(tok, "niah", length=n, seed=3).prompt for n in (700, 450)]
  budget, chunk = 128, 128
  fields = {"window": 16} if name == "snapkv" else {}
  before = dict(generate_lib.COMPILE_COUNT)
  r = kvjax.generate(smollm2_lm, prompts, policy=policies.get(name, **fields), budget=budget,
                     max_new_tokens=4, prefill_chunk=chunk)
  # One program serves every chunk (offsets and lengths are arrays, not statics).
  assert generate_lib.COMPILE_COUNT["prefill_chunk"] == before["prefill_chunk"] + 1
  testing.assert_cache_consistent(r.cache)
  cfg = smollm2_lm.config
  budgets = r.cache.capacity[0][0]
  # The pool has room for the budget (+ the decode tokens, or PagedEviction's one
  # token past the budget before a page goes): the chunk is never in it.
  grow = 1 if name == "paged_eviction" else 0 if policies.get(name).evicts_during_decode else 4
  assert budgets == -(-(budget + grow) // 16) * 16
  assert budgets == max(r.cache.capacity[l][0] for l in range(cfg.num_layers))
  kept = np.asarray(r.cache.kept_positions())  # [B, L, K, S]
  for i, n in enumerate(r.stats.prompt_tokens):
    held = (kept[i] >= 0).sum(-1)  # [L, K]
    if name in ("snapkv", "knorm"):  # the budget, then the 3 decoded tokens appended
      np.testing.assert_array_equal(held, budget + 3, err_msg=name)
    elif name == "streaming_llm":  # a slot evicted before each append
      np.testing.assert_array_equal(held, budget, err_msg=name)
    else:  # PagedEviction: appends, and a whole page of 16 goes once past the budget
      assert held.max() <= budget + 16 and held.min() > budget - 16, (held.min(), held.max())
    assert (kept[i].max(-1) == n + 2).all()  # the newest token is there
    if name == "snapkv":  # the window (the question's end) survived every compression
      for pos in range(n - 16, n):
        assert ((kept[i] == pos).sum(-1) == 1).all()


def test_bad_chunks_are_refused(smollm2_lm):
  with pytest.raises(ValueError, match="cannot compress a chunked prefill"):
    kvjax.generate(smollm2_lm, ["hello"], policy="h2o", budget=64, prefill_chunk=64)
  with pytest.raises(ValueError, match="must hold policy 'snapkv'"):
    kvjax.generate(smollm2_lm, ["hello"], policy="snapkv", budget=128, prefill_chunk=32)
  with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
    kvjax.generate(smollm2_lm, ["hello"], prefill_chunk=-5)


def test_a_chunk_program_updates_the_pools_in_place():
  # The chunk never enters the pool before compression, and every write of the
  # compression follows the reads of the pools: XLA copies no pool. (Sixteen
  # layers: the pools are larger than one layer's scratch.)
  cache = PagedKVCache.create(batch_size=1, capacity=64, num_layers=16, num_kv_heads=2,
                              head_dim=16, page_size=8)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 24, heads, 16)), jnp.float32)
             for heads in (4, 2, 2))
  snapkv = policies.get("snapkv", window=8)
  select = snapkv.select(execution.Execution(),
                         testing.layout_for(snapkv, 32, 24, num_layers=16, num_kv_heads=2))

  def program(cache, q, k, v):
    for start in (0, 12):  # the second chunk compresses cached entries and itself
      cache, _ = attention.chunk_attention(
          cache, 5, q[:, start:start + 12], k[:, start:start + 12], v[:, start:start + 12],
          jnp.arange(start, start + 12)[None], jnp.array([12]), select=select)
    return cache

  fn = jax.jit(program, donate_argnums=0).lower(cache, q, k, v).compile()
  assert fn.memory_analysis().temp_size_in_bytes < cache.k_pages.nbytes
