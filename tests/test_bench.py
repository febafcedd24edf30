"""Benchmark plumbing on tiny configurations: rows, fields, files. No timing assertions."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from kvjax import policies
from kvjax.bench import report
from kvjax.bench import runner
from kvjax.eval import policy_entries
from kvjax.models.config import Gemma3Config

FIELDS = ("model", "policy", "budget", "context_length", "batch_size", "decode_steps", "fill",
          "backend", "decode_ms_per_token", "decode_tokens_per_s", "prefill_s", "kv_bytes",
          "peak_rss_bytes", "rss_after_load_bytes", "load_peak_rss_bytes",
          "rss_file_after_load_bytes", "memory_note",
          "scan_layers", "buffer_peak_bytes", "buffer_peak_program", "compilation_cache",
          "programs_compiled", "programs_from_cache")


@pytest.mark.parametrize("fill", ["prompt", "synthetic"])
@pytest.mark.parametrize("policy, budget", [("full", None), ("streaming_llm", 64)])
def test_measure_row(smollm2_lm, fill, policy, budget):
  cfg = runner.BenchConfig(policy=policy, budget=budget, context_length=160, decode_steps=3,
                           repeats=1, fill=fill)
  row = runner.measure(cfg, smollm2_lm)
  for field in FIELDS:
    assert field in row, field
  assert (row["model"], row["policy"], row["budget"], row["context_length"], row["batch_size"],
          row["fill"], row["scan_layers"]) == (
              cfg.model, policy, budget, 160, 1, fill, smollm2_lm.scan_layers)
  # The policy ran at its defaults (no --window), each of them recorded.
  assert row["policy_fields"] == {}
  assert row["policy_settings"] == policy_entries.settings(policies.get(policy))
  assert row["decode_steps"] == 3  # as asked: forward passes timed (the first token is prefill's)
  assert "times 3 decode steps" in row["decode_note"]
  assert row["backend"] in ("xla", "pallas", "native")  # "auto" resolved
  assert row["decode_ms_per_token"] > 0
  assert row["decode_tokens_per_s"] == pytest.approx(1e3 / row["decode_ms_per_token"])  # B = 1
  # The weights (dequantized to float32: memory the process wrote) are resident once loaded.
  params = sum(x.nbytes for x in jax.tree.leaves(smollm2_lm.params))
  assert row["rss_after_load_bytes"] > params
  assert 0 < row["rss_file_after_load_bytes"] < row["rss_after_load_bytes"]
  # (ru_maxrss is updated lazily: VmRSS may read a little above it.)
  assert params < row["load_peak_rss_bytes"] <= row["peak_rss_bytes"]
  # The weights and the cache are live while the decode program runs.
  assert row["buffer_peak_bytes"] >= params + row["kv_bytes"]
  # A synthetic fill runs no prefill program: only decode is observed.
  assert row["buffer_peak_program"] in (("decode",) if fill == "synthetic"
                                        else ("prefill", "decode"))
  assert row["compilation_cache"] is None and row["programs_from_cache"] == 0
  if jax.default_backend() == "cpu":
    assert row["device_peak_bytes"] is None  # the CPU client keeps no allocator statistics
  for field in FIELDS:  # the note says what each memory figure measures
    if (field.endswith("_bytes") and field != "kv_bytes") or field.startswith("programs_"):
      assert field in row["memory_note"], field
  assert (row["prefill_s"] is None) == (fill == "synthetic")
  c = smollm2_lm.config
  per_slot = c.num_layers * c.num_kv_heads * c.head_dim * 4 * 2  # float32 keys + values
  if fill == "synthetic":
    entries = 160 if budget is None else budget
    assert row["prompt_tokens"] is None
  else:  # "full" keeps the prompt right-padded to generate's pad_multiple, 64
    assert 158 <= row["prompt_tokens"] <= 160  # make_sample: within a token or two of it
    entries = -(-row["prompt_tokens"] // 64) * 64 if budget is None else budget
  grow = 0 if policy == "streaming_llm" else 4  # 3 steps + the first token; decode-evicting
  # policies stay at the budget
  assert row["kv_bytes"] == per_slot * -(-(entries + grow) // 16) * 16
  # The estimate made before running: its KV part is the cache's exactly; the whole
  # (weights + cache + a forward's activations) is near what the buffers peaked at.
  assert row["estimated_parts"]["kv"] == row["kv_bytes"]
  assert row["estimated_parts"]["weights"] == params
  assert 0.8 * row["buffer_peak_bytes"] < row["estimated_bytes"] < 1.2 * row["buffer_peak_bytes"]


def test_synthetic_cache_holds_the_most_recent_positions(smollm2_lm):
  from kvjax import policies
  cfg = runner.BenchConfig(policy="snapkv", budget=48, context_length=1000, decode_steps=4)
  cache, budgets = runner.synthetic_cache(smollm2_lm, cfg, policies.get("snapkv"))
  assert budgets == (48,) * smollm2_lm.config.num_layers
  kept = np.asarray(cache.kept_positions())[0, 0, 0]
  np.testing.assert_array_equal(kept[:48], np.arange(952, 1000))
  assert (kept[48:] == -1).all()


def test_synthetic_cache_per_layer_budgets(smollm2_lm):
  """PyramidKV's budgets differ by layer: each layer holds its own most recent positions."""
  from kvjax import policies
  cfg = runner.BenchConfig(policy="pyramidkv", budget=256, context_length=700, decode_steps=2,
                           batch_size=2)
  policy = policies.get("pyramidkv", window=8)
  cache, budgets = runner.synthetic_cache(smollm2_lm, cfg, policy, seed=3)
  assert budgets == runner.cache_budgets(smollm2_lm, cfg, policy) and len(set(budgets)) > 1
  kept = np.asarray(cache.kept_positions())  # [B, L, K, S]
  lengths = np.asarray(cache.lengths)
  for l, b in enumerate(budgets):
    assert (lengths[:, l] == b).all()
    np.testing.assert_array_equal(kept[:, l, :, :b],
                                  np.broadcast_to(np.arange(700 - b, 700), kept[:, l, :, :b].shape))
    assert (kept[:, l, :, b:] == -1).all()
  assert int(cache.num_free) == cache.num_pages - int(np.ceil(lengths / 16).sum())
  keys = np.asarray(cache.k_pages, np.float32)
  assert np.isfinite(keys).all() and keys.std() > 0.5  # random normal entries were written


def test_cli_writes_rows_summary_and_plots(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--policies=full,snapkv:window=8", "--budget=32",
       "--context_lengths=96", "--decode_steps=2", "--repeats=1", "--isolate=false",
       f"--out={tmp_path}"], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("snapkv", 32)]
  assert [r["policy_fields"] for r in rows] == [{}, {"window": 8}]  # the entry's own field
  assert rows[1]["policy_settings"] == policy_entries.settings(policies.get("snapkv", window=8))
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "decode_ms_per_token.png", "peak_memory.png", "results.jsonl", "summary.md"]
  assert "## Decode ms per token" in proc.stdout and "| snapkv (window=8) @ 32 |" in proc.stdout
  settings = policy_entries.settings_text(rows[1]["policy_settings"])
  assert f"| snapkv (window=8) | {settings} |" in proc.stdout.split("## Settings")[1]


@pytest.mark.slow  # about 60 s: two benchmark runs
def test_compilation_cache_second_run_loads_every_program(tmp_path):
  """Run twice on one cache folder: the first run's child compiles, the second's loads."""
  rows = []
  for run in ("first", "second"):
    out = tmp_path / run
    proc = subprocess.run(
        [sys.executable, "-m", "kvjax.bench", "--policies=streaming_llm", "--budget=32",
         "--context_lengths=96", "--decode_steps=2", "--repeats=1",
         f"--compilation_cache={tmp_path / 'xla'}", f"--out={out}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    rows.append(row)
  first, second = rows
  assert first["compilation_cache"] == str(tmp_path / "xla")
  assert first["programs_compiled"] > 0 and first["programs_from_cache"] == 0
  assert second["programs_compiled"] == 0
  assert second["programs_from_cache"] == first["programs_compiled"]
  assert "loaded from the compilation cache, 0 compiled" in (
      tmp_path / "second" / "summary.md").read_text()


def test_entry_fields_reach_the_policy_and_survive_the_child_json():
  import dataclasses
  cfg = runner.BenchConfig(policy="paged_eviction", entry_fields=(("candidates", 3),),
                           budget=64, window=8)
  assert cfg.policy_fields == {"window": 8, "candidates": 3}
  assert cfg.label == "paged_eviction (candidates=3, window=8)"
  assert runner.make_policy(cfg) == policies.get("paged_eviction", candidates=3, window=8)
  child = runner.BenchConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
  assert child == cfg and hash(child) == hash(cfg)  # the pairs are tuples again
  entry = runner.BenchConfig(policy="sablock", entry_fields=(("window", 4),), budget=64,
                             window=8)
  assert runner.make_policy(entry).window == 4  # the entry's field wins over --window


def test_summary_labels_each_entry_and_lists_its_settings():
  row = dict(model="m", batch_size=1, device="cpu", backend="xla", context_length=96,
             prefill_chunk=0, fill="prompt", decode_ms_per_token=2.0, prefill_s=0.1,
             kv_bytes=2**20, peak_rss_bytes=2**30)
  rows = [dict(row, policy="full", budget=None, policy_fields={}, policy_settings={}),
          dict(row, policy="paged_eviction", budget=32, policy_fields={},
               policy_settings={"candidates": 0, "per_head": False}),
          dict(row, policy="paged_eviction", budget=32, policy_fields={"candidates": 3},
               policy_settings={"candidates": 3, "per_head": False}),
          dict(row, policy="snapkv", budget=32)]  # a row written before settings were kept
  text = report.summary_markdown(rows)
  table, settings = text.split("## Settings")
  for label in ("full", "paged_eviction @ 32", "paged_eviction (candidates=3) @ 32",
                "snapkv @ 32"):
    assert f"| {label} | 2.0 |" in table, label
  assert settings.splitlines()[-4:] == [
      "| full | no fields |", "| paged_eviction | candidates=0, per_head=false |",
      "| paged_eviction (candidates=3) | candidates=3, per_head=false |",
      "| snapkv | not recorded |"]


@pytest.mark.slow  # loads and compiles the unrolled model in a child process
def test_cli_noscan_layers_loads_the_unrolled_model(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--policies=streaming_llm", "--budget=32",
       "--context_lengths=96", "--decode_steps=2", "--repeats=1", "--isolate=false",
       "--noscan_layers", f"--out={tmp_path}"], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (row,) = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert row["scan_layers"] is False and row["decode_ms_per_token"] > 0
  assert "layers unrolled" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--context_lengths=abc"], "--context_lengths must be a comma list of ints"),
    (["--policies=nope"], "unknown policy 'nope'"),
    (["--decode_steps=0"], "--decode_steps must be >= 1"),
    (["--bogus"], "Unknown command line flag"),
])
def test_bad_flags_exit_2(tmp_path, args, message):
  proc = subprocess.run([sys.executable, "-m", "kvjax.bench", f"--out={tmp_path}", *args],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], proc.stderr


TINY = dict(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=8, intermediate_size=64, max_position_embeddings=512)


@pytest.mark.parametrize("policy, budget, batch, chunk", [
    ("snapkv", 48, 2, 0), ("pyramidkv", 96, 2, 0),
    ("streaming_llm", 40, 3, 0), ("snapkv", 48, 1, 64), ("full", None, 2, 0)])
def test_memory_estimate_of_the_cache_is_exact(policy, budget, batch, chunk):
  """The estimate's cache part is every byte of the cache the run allocates, keys and
  values apart (kv_bytes): a generate on a prompt, and the bench's synthetic fill."""
  import kvjax
  from kvjax import policies
  from kvjax.bench import memory
  lm = kvjax.init_random(kvjax.LlamaConfig(**TINY), seed=1)
  weights = sum(x.nbytes for x in jax.tree.leaves(lm.params))
  pol = policies.get(policy, **policies.window_fields(policy, 8))
  prompt = (np.arange(150) % 90 + 3).tolist()  # 150 tokens: padded to 192 (or 3 chunks)
  result = kvjax.generate(lm, [prompt] * batch, policy=pol, budget=budget, max_new_tokens=4,
                          stop_ids=[], prefill_chunk=chunk)
  cfg = runner.BenchConfig(policy=policy, budget=budget, context_length=150, batch_size=batch,
                           decode_steps=3, prefill_chunk=chunk, window=8)
  est = memory.estimate(lm.config, weights=weights, itemsize=4, policy=pol, budget=budget,
                        context_length=150, batch_size=batch, decode_steps=3, fill="prompt",
                        prefill_chunk=chunk)
  assert est.kv == result.stats.kv_bytes == result.cache.kv_bytes
  assert est.cache == sum(x.nbytes for x in jax.tree.leaves(result.cache))
  assert est.weights == weights and est.activations > 0
  assert est.total == weights + est.cache + est.activations
  if chunk:
    return
  cache, _ = runner.synthetic_cache(lm, cfg, pol)
  est = memory.estimate(lm.config, weights=weights, itemsize=4, policy=pol, budget=budget,
                        context_length=150, batch_size=batch, decode_steps=3, fill="synthetic")
  assert est.kv == cache.kv_bytes
  assert est.cache == sum(x.nbytes for x in jax.tree.leaves(cache))


def test_memory_estimate_grows_with_batch_steps_and_length():
  import kvjax
  from kvjax import policies
  from kvjax.bench import memory
  config = kvjax.LlamaConfig(**TINY)
  base = dict(weights=1000, itemsize=4, policy=policies.get("full"), budget=None,
              context_length=256, batch_size=1, decode_steps=8, fill="synthetic")
  e = lambda **kw: memory.estimate(config, **{**base, **kw}).total
  assert e(batch_size=2) > e() and e(decode_steps=400) > e() and e(context_length=4096) > e()
  # A full cache of 10**9 tokens: 2 (k, v) x L x K x H x 4 bytes a token, at least.
  assert e(context_length=10**9) > 10**9 * 2 * 3 * 2 * 8 * 4


def test_a_synthetic_fill_of_a_model_with_rings_is_refused():
  config = Gemma3Config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, intermediate_size=64,
                        max_position_embeddings=1024, sliding_window=64,
                        layer_types=("sliding_attention", "full_attention"))
  cfg = runner.BenchConfig(context_length=512, decode_steps=3, fill="synthetic")
  with pytest.raises(ValueError, match="sliding-window layers.*--fill=prompt"):
    runner.resolve_fill(cfg, config)
  global_only = dataclasses.replace(config, layer_types=("full_attention",) * 2)
  assert runner.resolve_fill(cfg, global_only) == "synthetic"
