"""The serving engine: isolation from the other requests, fixed shapes, pages given back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax import testing
from kvjax.serve import Engine, parse_bytes

TINY = kvjax.LlamaConfig(
    vocab_size=211, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=1024, tie_embeddings=False,
    rope_theta=1e4)
# Delimiter ids for the policies that cut there (SABlock, DynSplit-KV, SentenceKV).
DELIMITERS = (5, 6, 7)


@pytest.fixture(scope="module")
def tiny():
  return kvjax.init_random(TINY, seed=2)


def _prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  out = []
  for n in rng.integers(low, high, count):
    ids = rng.integers(10, TINY.vocab_size, n)
    ids[rng.random(n) < 0.1] = DELIMITERS[0]
    out.append(ids.tolist())
  return out


def _engine(lm, name, budget, **kw):
  policy = testing.policy_for(name, lm.config, "/tmp", DELIMITERS)
  fields = policies.window_fields(name, 16)  # an observation window the budget can hold
  if name == "paged_eviction":
    fields["page_size"] = 8
  policy = policies.get(policy, **fields)
  # One chunk between two dispatches: long prompts come in while others decode.
  defaults = dict(num_pages=4000, max_slots=4, max_prompt_tokens=512, max_tokens=12,
                  prefill_chunk=128, prefill_per_step=128, page_size=8, steps_per_dispatch=3,
                  backend="xla")
  return Engine(lm, policy=policy, budget=budget, **{**defaults, **kw}), policy


def _staggered(engine, prompts, max_tokens):
  """Submits the prompts a few at a time between steps; returns their completions."""
  rng = np.random.default_rng(1)
  pending, ids, done = list(prompts), [], {}
  while pending or engine.running or engine.waiting:
    for _ in range(int(rng.integers(0, 3)) if engine.running else 1):
      if pending:
        ids.append(engine.submit(pending.pop(0), max_tokens=int(max_tokens[len(ids)])))
    done.update({c.id: c for c in engine.step()})
  return [done[i] for i in ids]


# Each decode rule (keep, evict a token, evict a page) and both prefills (chunked,
# one shot) in the default suite; the other policies with -m slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,budget", [
    ("full", None), ("snapkv", 48), ("paged_eviction", 48), ("h2o", 48),
    pytest.param("streaming_llm", 40, marks=_SLOW), pytest.param("sablock", 48, marks=_SLOW),
    pytest.param("knorm", 48, marks=_SLOW), pytest.param("dynsplit_kv", 48, marks=_SLOW),
    pytest.param("chunkkv", 48, marks=_SLOW), pytest.param("sentencekv", 48, marks=_SLOW),
    pytest.param("pyramidkv", 48, marks=_SLOW)])
def test_each_request_gets_generates_tokens_among_others(tiny, name, budget):
  """Greedy tokens of every request equal ``generate``'s on its prompt alone, while
  others arrive, run and leave around it."""
  engine, policy = _engine(tiny, name, budget)
  prompts = _prompts(7, 60, 400)
  max_tokens = np.random.default_rng(3).integers(1, 13, len(prompts))
  got = _staggered(engine, prompts, max_tokens)
  chunk = engine.chunk
  for prompt, n, completion in zip(prompts, max_tokens, got):
    # One-shot policies: the engine pads a prompt to a power of two x 64.
    pad = {} if chunk else dict(pad_multiple=int(64 * 2 ** np.ceil(np.log2(len(prompt) / 64))))
    # The first n of 12 greedy tokens (one compiled decode for every request).
    want = kvjax.generate(tiny, [prompt], policy=policy, budget=budget, max_new_tokens=12,
                          prefill_chunk=chunk, page_size=8, backend="xla", stop_ids=[],
                          **pad)
    assert completion.token_ids == want.token_ids[0][:n], (name, len(prompt))
  assert engine.pages_in_use == 0
  assert int(engine.cache.num_free) == engine.num_pages  # every page back on the free stack


@pytest.mark.parametrize("name,budget", [
    ("snapkv", 48), ("h2o", 48), pytest.param("full", None, marks=_SLOW),
    pytest.param("paged_eviction", 48, marks=_SLOW), pytest.param("sablock", 48, marks=_SLOW),
    pytest.param("streaming_llm", 40, marks=_SLOW)])
def test_a_request_among_31_others_gets_its_tokens_alone(tiny, name, budget):
  """32 requests arriving at random times over 8 slots: each one's tokens are those it
  gets alone in the engine (which are ``generate``'s, the test above)."""
  engine, _ = _engine(tiny, name, budget, max_slots=8, prefill_per_step=512)
  prompts = _prompts(32, 20, 500, seed=11)
  max_tokens = np.random.default_rng(12).integers(6, 13, len(prompts))
  rng, pending, ids, done, running = np.random.default_rng(13), list(prompts), [], {}, []
  while pending or engine.has_work:  # 0 to 4 arrive between two steps
    for _ in range(int(rng.integers(0, 5))):
      if pending:
        ids.append(engine.submit(pending.pop(0), max_tokens=int(max_tokens[len(ids)])))
    done.update({c.id: c for c in engine.step()})
    running.append(engine.running)
  together = [done[i] for i in ids]
  assert engine.stats["admitted"] == 32 and max(running) >= 4  # many ran at once
  for prompt, n, got in zip(prompts, max_tokens, together):
    engine.submit(prompt, max_tokens=int(n))
    alone, = engine.run()
    assert got.token_ids == alone.token_ids, (name, len(prompt))


def test_per_head_layouts_are_refused(tiny):
  with pytest.raises(ValueError, match="heads sizes of their own"):
    _engine(tiny, "adakv", 48)


def test_the_pool_bounds_the_running_requests_and_pages_come_back(tiny):
  engine, _ = _engine(tiny, "snapkv", 48)
  # Two requests at their most, and the pages one more dispatch may take.
  small, _ = _engine(tiny, "snapkv", 48, num_pages=2 * engine.pages_for(512, 12) + 12)
  for prompt in _prompts(6, 380, 400):
    small.submit(prompt, max_tokens=12)
  most = 0
  while small.running or small.waiting:
    small.step()
    most = max(most, small.running)
    assert small.pages_in_use <= small.num_pages
  assert most == 2  # two fit at a time, four would by slots alone
  assert small.stats["admitted"] == 6 and small.stats["preemptions"] == 0
  assert small.pages_in_use == 0


def test_a_short_pool_preempts_the_newest_and_its_tokens_come_out_the_same(tiny):
  """Under the full cache, generations grow until the pool runs short: the newest
  request is preempted, recomputed later, and every request still gets
  ``generate``'s tokens."""
  engine, policy = _engine(tiny, "full", None, max_tokens=48, max_prompt_tokens=128)
  alone = engine.pages_for(engine.max_prompt, engine.max_tokens)
  engine, policy = _engine(tiny, "full", None, max_tokens=48, max_prompt_tokens=128,
                           num_pages=alone + alone // 2)
  prompts = _prompts(4, 90, 120, seed=4)
  ids = [engine.submit(p, max_tokens=48) for p in prompts]
  done = {}
  while engine.has_work:
    done.update({c.id: c for c in engine.step()})
    assert int(engine.cache.num_free) >= 0 and engine.pages_in_use <= engine.num_pages
  assert engine.stats["preemptions"] > 0
  for prompt, i in zip(prompts, ids):
    want = kvjax.generate(tiny, [prompt], policy=policy, max_new_tokens=48, prefill_chunk=128,
                          page_size=8, backend="xla", stop_ids=[])
    assert done[i].token_ids == want.token_ids[0]
  assert int(engine.cache.num_free) == engine.num_pages


def test_running_requests_decode_while_a_long_prompt_comes_in(tiny):
  engine, _ = _engine(tiny, "snapkv", 48, max_tokens=12)
  short = engine.submit(_prompts(1, 30, 31)[0], max_tokens=12)
  engine.step()
  engine.submit(_prompts(1, 500, 501)[0], max_tokens=4)  # four chunks
  seen = []
  for _ in range(2):  # two of the four chunks
    engine.step()
    seen.append(len(engine.tokens_of(short)))
  assert seen == sorted(seen) and seen[-1] > seen[0]  # it kept generating
  assert engine.tokens_of(99) is None


def test_cancel_gives_the_pages_back_at_once(tiny):
  engine, _ = _engine(tiny, "full", None, max_tokens=12)
  first = engine.submit(_prompts(1, 300, 301)[0], max_tokens=12)
  waiting = engine.submit(_prompts(1, 300, 301)[0], max_tokens=12)
  engine.step()
  assert engine.pages_in_use > 0
  assert engine.cancel(first) and engine.cancel(waiting) and not engine.cancel(99)
  assert engine.pages_in_use == 0 and engine.running == engine.waiting == 0
  assert int(engine.cache.num_free) == engine.num_pages


def test_nothing_recompiles_as_requests_come_and_go(tiny):
  engine, _ = _engine(tiny, "snapkv", 48, max_slots=8)
  # Short prompts, so that some are admitted beside others: every program runs.
  warm = [engine.submit(p, max_tokens=4) for p in _prompts(3, 20, 60, seed=7)]
  list(engine.run())
  with testing.count_compilations() as compiles:
    got = _staggered(engine, _prompts(100, 20, 500, seed=8),
                     np.random.default_rng(9).integers(1, 13, 100))
  assert len(got) == 100 and len(warm) == 3
  assert compiles[0] == 0, f"{compiles[0]} programs compiled while serving"


def test_bad_requests_and_sizes_are_refused(tiny):
  engine, _ = _engine(tiny, "snapkv", 48)
  with pytest.raises(ValueError, match="exceeds the engine's max_prompt_tokens"):
    engine.submit([11] * 700)
  for kwargs, match in [(dict(max_tokens=0), "max_tokens"), (dict(max_tokens=13), "max_tokens"),
                        (dict(temperature=-1.0), "temperature"), (dict(seed=-1), "seed"),
                        (dict(top_k=-1), "top_k"), (dict(stop_ids=[TINY.vocab_size]), "stop_ids"),
                        (dict(stop=[""]), "stop"), (dict(stop_ids=list(range(9))), "stop_ids")]:
    with pytest.raises(ValueError, match=match):
      engine.submit([11, 12, 13], **kwargs)
  with pytest.raises(ValueError, match="one of prompt and messages"):
    engine.submit()
  with pytest.raises(ValueError, match="tokenizer"):
    engine.submit(messages=[{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match="cannot hold one request"):
    _engine(tiny, "full", None, num_pages=10)
  with pytest.raises(ValueError, match="one of kv_memory"):
    _engine(tiny, "full", None, num_pages=None)
  assert parse_bytes("2KiB") == 2048 and parse_bytes("1.5GB") == 1_500_000_000
  with pytest.raises(ValueError, match="kv_memory"):
    parse_bytes("lots")


def test_ignore_eos_runs_past_the_tokenizers_stop_ids(tiny):
  engine, _ = _engine(tiny, "snapkv", 48)
  prompt = _prompts(1, 100, 101)[0]
  engine.submit(prompt, max_tokens=12)
  probe, = engine.run()
  engine.stop_ids = (probe.token_ids[2],)  # as if the tokenizer's EOS came third
  stopped = engine.submit(prompt, max_tokens=12)
  ran_on = engine.submit(prompt, max_tokens=12, ignore_eos=True)
  out = {c.id: c for c in engine.run()}
  assert out[stopped].token_ids == probe.token_ids[:3] and out[stopped].finish_reason == "stop"
  assert out[ran_on].token_ids == probe.token_ids and out[ran_on].finish_reason == "length"


def test_sampled_requests_are_reproducible_by_seed(tiny):
  engine, _ = _engine(tiny, "snapkv", 48)
  prompt = _prompts(1, 100, 101)[0]
  a, b, c = (engine.submit(prompt, max_tokens=12, temperature=1.0, seed=s) for s in (5, 5, 6))
  greedy = engine.submit(prompt, max_tokens=12)
  top1 = engine.submit(prompt, max_tokens=12, temperature=1.0, top_k=1, seed=5)
  out = {x.id: x.token_ids for x in engine.run()}
  assert out[a] == out[b] and out[a] != out[c]
  assert out[top1] == out[greedy]  # the one most likely token, drawn


@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.5, 2.0]])
def test_sampling_without_branches_draws_the_same(temperature):
  """A GPU's decode samples without lax.cond (its predicate is a host round trip)."""
  from kvjax.serve import programs  # pylint: disable=import-outside-toplevel
  logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
  args = (logits, np.asarray(temperature, np.float32), np.asarray([0, 0, 5, 1], np.int32),
          np.arange(4, dtype=np.uint32), np.full(4, 7, np.int32))
  with_branches = np.asarray(programs.sample(*args))
  np.testing.assert_array_equal(with_branches, programs.sample(*args, branches=False))
  assert with_branches[0] == logits[0].argmax() and with_branches[3] == logits[3].argmax()


def test_kv_memory_sizes_the_pool(tiny):
  engine, _ = _engine(tiny, "snapkv", 48, num_pages=None, kv_memory="4MiB")
  page_bytes = 2 * 8 * TINY.head_dim * 4
  assert engine.num_pages == 4 * 2 ** 20 // page_bytes
  assert engine.cache.kv_bytes == engine.num_pages * page_bytes


def test_chat_messages_are_the_chat_templates_prompt(smollm2_lm):
  engine = Engine(smollm2_lm, policy="snapkv", budget=96, num_pages=2000, max_slots=2,
                  max_prompt_tokens=128, max_tokens=6, prefill_chunk=64, backend="xla")
  text = "Name a colour."
  rid = engine.submit(messages=[{"role": "user", "content": text}])
  with pytest.raises(ValueError, match="message 0"):
    engine.submit(messages=[{"role": "user"}])
  got, = engine.run()
  want = kvjax.generate(smollm2_lm, [text], policy="snapkv", budget=96, max_new_tokens=6,
                        prefill_chunk=64, chat_template=True, backend="xla")
  assert got.id == rid and got.token_ids == want.token_ids[0][:len(got.token_ids)]
  assert got.text == want.texts[0][:len(got.text)]


def test_on_a_mesh_each_request_gets_the_single_devices_tokens():
  """Slots over the data axis (each shard's in its own part of the pool), KV heads
  over the model axis: the same tokens as on one device, every page back."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, __file__, "data:2,model:2", "snapkv:48,h2o:48"],
                        env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  for name, row in json.loads(done.stdout.splitlines()[-1]).items():
    assert row["same_tokens"] and row["preempted"] == 0, (name, row)
    assert row["free"] == row["pages"] == 4000, (name, row)


def _mesh_job(shape: str, configs: str) -> None:
  """Runs a staggered workload on one device and on a mesh of ``shape``; prints JSON."""
  from kvjax import sharding  # pylint: disable=import-outside-toplevel
  tiny = kvjax.init_random(TINY, seed=2)
  mesh, out = sharding.make_mesh(shape), {}
  for config in configs.split(","):
    name, budget = config.split(":")
    prompts = _prompts(6, 60, 400)
    max_tokens = np.random.default_rng(3).integers(1, 13, len(prompts))
    alone, _ = _engine(tiny, name, int(budget))
    meshed, _ = _engine(tiny, name, int(budget), mesh=mesh)
    want = [c.token_ids for c in _staggered(alone, prompts, max_tokens)]
    got = [c.token_ids for c in _staggered(meshed, prompts, max_tokens)]
    out[name] = dict(same_tokens=want == got, preempted=meshed.stats["preemptions"],
                     free=int(np.asarray(meshed.cache.num_free).sum()), pages=meshed.num_pages)
  print(json.dumps(out))


if __name__ == "__main__":
  _mesh_job(*sys.argv[1:])
