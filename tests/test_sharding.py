"""generate on a device mesh: the same tokens and kept positions as one device.

The pytest worker has one CPU device, and XLA fixes the device count when it
starts, so every mesh run happens in a child process of this file
(``python tests/test_sharding.py <job json>``) with 8 simulated devices (or 4
in each of two processes joined by ``jax.distributed``). A child runs the
one-device baseline and the meshes itself and prints one JSON line per run.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kvjax
from kvjax.sharding import layout
from kvjax.sharding import mesh as mesh_lib

# A config with 8 KV heads (every mesh of 8 devices splits it), SmolLM2's
# vocabulary so that SmolLM2's tokenizer (and its delimiters) serve.
RANDOM = dict(name="random-8kv", vocab_size=49152, hidden_size=64, num_layers=2, num_heads=16,
              num_kv_heads=8, head_dim=16, intermediate_size=128,
              max_position_embeddings=1024)
MESHES_8 = [(8, 1), (4, 2), (2, 4), (1, 8)]
POLICIES = ["full", "snapkv", "pyramidkv", "paged_eviction", "sablock", "dynsplit_kv"]
CHUNKED = ["full", "snapkv", "pyramidkv", "paged_eviction"]  # the others need the whole prompt
BUDGET = 96
CHUNK = 64


# ------------------------------------------------------------------- child side

def _model(name: str):
  smollm2 = kvjax.load()
  if name == "smollm2":
    return smollm2
  import dataclasses
  return dataclasses.replace(kvjax.init_random(kvjax.LlamaConfig(**RANDOM), seed=1),
                             tokenizer=smollm2.tokenizer)


def _prompts(batch: int, policy: str, model: str) -> list:
  """Slices of the example document; for PagedEviction on the random model, distinct ids.

  In layer 0 a repeated token's key and value norms are equal up to RoPE's
  rounding, so PagedEviction's norm scores tie, and which tied token it keeps
  follows float rounding that differs with the batch a device computes (one
  device with 8 sequences against 8 devices with 1 each), on a single device
  as well (docs/sharding.md). The random model's layer 1 keeps such ties.
  """
  if policy == "paged_eviction" and model == "random":
    rng = np.random.default_rng(0)
    return [rng.permutation(RANDOM["vocab_size"])[:120 + 20 * i].tolist() for i in range(batch)]
  text = kvjax.tasks.example_document().text
  return [text[200 * i:200 * i + 500 + 60 * i] for i in range(batch)]


def _decode_collectives(mesh) -> list[tuple[str, int]]:
  """(op, result bytes) of every collective in the compiled decode program on ``mesh``."""
  from kvjax.generation import compile as compile_lib
  found = []
  for key, program in compile_lib._PROGRAMS.items():
    if key[0] == "decode" and dict(key[1]).get("mesh") == mesh:
      for dtype, dims, op in re.findall(
          r"= ([a-z]+\d*)\[([\d,]*)\][^ ]* (all-gather|all-reduce|all-to-all|reduce-scatter|"
          r"collective-permute)", program.as_text()):
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
        found.append((op, size * bits // 8))
  return found


def _run(lm, job, policy, chunk, mesh):
  budget = None if policy == "full" else BUDGET
  return kvjax.generate(lm, _prompts(job["batch"], policy, job["model"]), policy=policy,
                        budget=budget,
                        max_new_tokens=job["new_tokens"], prefill_chunk=chunk, mesh=mesh,
                        backend=job.get("backend", "auto"))


def child(job: dict) -> None:
  """Runs ``job`` and prints a JSON line per (policy, chunk, mesh) run."""
  if "process_id" in job:  # XLA_FLAGS (4 devices) comes from the parent
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{job['port']}", num_processes=2,
                               process_id=job["process_id"])
  lm = _model(job["model"])
  for policy in job["policies"]:
    for chunk in job["chunks"]:
      if chunk and policy not in CHUNKED:
        continue
      base = None if job.get("no_baseline") else _run(lm, job, policy, chunk, None)
      for shape in job["meshes"]:
        mesh = kvjax.sharding.make_mesh(tuple(shape), devices=jax.devices()[:np.prod(shape)])
        result = _run(lm, job, policy, chunk, mesh)
        pool = result.cache.k_pages
        row = dict(policy=policy, chunk=chunk, mesh=shape, tokens=result.token_ids,
                   kv_bytes=result.stats.kv_bytes,
                   kv_bytes_per_device=result.stats.kv_bytes_per_device,
                   pool_shard_bytes=[s.data.nbytes for s in pool.addressable_shards],
                   pool_spec=str(pool.sharding.spec),
                   table_spec=str(result.cache.page_table.sharding.spec),
                   collectives=_decode_collectives(mesh))
        if base is not None:
          row.update(same_tokens=result.token_ids == base.token_ids, same_kept=bool(
              np.array_equal(np.asarray(result.cache.kept_positions()),
                             np.asarray(base.cache.kept_positions()))))
        print("ROW " + json.dumps(row), flush=True)


# ------------------------------------------------------------------- test side

def _spawn(job: dict, devices: int = 8) -> subprocess.Popen:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, __file__, json.dumps(job)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _rows(process: subprocess.Popen, timeout: int = 900) -> list[dict]:
  out, err = process.communicate(timeout=timeout)
  assert process.returncode == 0, f"child failed:\n{err[-4000:]}"
  return [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]


def _job(**kwargs) -> dict:
  return dict(dict(model="random", batch=8, new_tokens=6, chunks=[0], meshes=MESHES_8),
              **kwargs)


def _check_rows(rows: list[dict], expected: int) -> None:
  assert len(rows) == expected
  for row in rows:
    where = f"{row['policy']} chunk={row['chunk']} mesh={row['mesh']}"
    assert row["same_tokens"], f"{where}: tokens differ from one device's"
    assert row["same_kept"], f"{where}: kept positions differ from one device's"
    d, m = row["mesh"]
    # Never replicated: each device holds 1 / (D * M) of the pool, in its own block.
    assert row["pool_spec"] == str(P(("data", "model"))), where
    assert row["table_spec"] == str(P("data", None, "model")), where
    assert row["kv_bytes_per_device"] * d * m == row["kv_bytes"], where
    assert set(row["pool_shard_bytes"]) == {row["kv_bytes"] // (2 * d * m)}, where
    # Decode moves no cache-sized operand between devices: its collectives
    # are the model's all-reduces, loop conditions and the tokens' gather.
    shard = row["kv_bytes"] // (2 * d * m)
    big = [c for c in row["collectives"] if c[1] >= shard]
    assert not big, f"{where}: collectives as large as a pool shard: {big}"
    assert all(op != "all-gather" or size <= 8 * 6 * 4 for op, size in row["collectives"]), (
        f"{where}: {row['collectives']}")


@pytest.mark.slow  # about 100 s; the mixed mesh below stays in the default suite
def test_every_mesh_of_eight_devices_equals_one_device():
  """(8,1), (4,2), (2,4) and (1,8), one-shot and chunked prefill, for SnapKV and
  PagedEviction (the one that evicts while decoding)."""
  rows = _rows(_spawn(_job(policies=["snapkv", "paged_eviction"], chunks=[0, CHUNK])))
  _check_rows(rows, 2 * 2 * len(MESHES_8))


def test_every_policy_on_a_mixed_mesh_equals_one_device():
  """The six policies on (2,4), one-shot and (where they can) chunked."""
  rows = _rows(_spawn(_job(policies=POLICIES, chunks=[0, CHUNK], meshes=[(2, 4)])))
  _check_rows(rows, len(POLICIES) + len(CHUNKED))


@pytest.mark.slow  # about 40 s
def test_pallas_kernels_run_per_device():
  """backend="pallas" (interpret mode on a CPU): paged attention, window scoring and
  compaction as Pallas calls inside each device's program, as on one device."""
  rows = _rows(_spawn(_job(policies=["snapkv", "paged_eviction"], meshes=[(2, 4)],
                           backend="pallas")))
  _check_rows(rows, 2)


@pytest.mark.slow  # ~3 minutes: every policy on every mesh
def test_every_policy_on_every_mesh_equals_one_device():
  rows = _rows(_spawn(_job(policies=POLICIES, chunks=[0, CHUNK])), timeout=1800)
  _check_rows(rows, (len(POLICIES) + len(CHUNKED)) * len(MESHES_8))


@pytest.mark.slow  # SmolLM2's 30 layers, compiled for each policy twice
def test_smollm2_on_meshes_its_three_kv_heads_divide():
  rows = _rows(_spawn(_job(model="smollm2", batch=2, policies=POLICIES, chunks=[0, 128],
                           meshes=[(2, 3), (1, 3)]), devices=6), timeout=1800)
  _check_rows(rows, (len(POLICIES) + len(CHUNKED)) * 2)


@pytest.mark.slow  # about 40 s: two processes
def test_two_processes_generate_what_one_device_does():
  """jax.distributed over localhost, gloo collectives, 4 CPU devices per process."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  job = _job(policies=["snapkv"], chunks=[0], meshes=[(2, 4)], no_baseline=True, port=port)
  children = [_spawn(dict(job, process_id=i), devices=4) for i in range(2)]
  rows = [_rows(c) for c in children]
  base = _run(_model("random"), job, "snapkv", 0, None)
  for i, (row,) in enumerate(rows):
    assert row["tokens"] == base.token_ids, f"process {i}"
    assert len(row["pool_shard_bytes"]) == 4  # its own 4 devices' blocks
    assert row["kv_bytes_per_device"] * 8 == row["kv_bytes"]


@pytest.mark.slow  # about 26 s: the eval CLI in child processes
def test_eval_cli_splits_the_kv_heads_over_a_mesh(tmp_path):
  """``--mesh=model:3`` on 3 devices: SmolLM2's heads split, rows say so; a data axis
  (the eval runs one sample at a time) is refused on one line, exit 2."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3",
             JAX_PLATFORMS="cpu")
  args = [sys.executable, "-m", "kvjax.eval", "--policies=full,snapkv", "--window=16", "--budgets=64",
          "--lengths=320", "--depths=0.5", "--haystacks=repeat"]
  done = subprocess.run(args + ["--mesh=model:3", f"--out={tmp_path}/a"], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
  assert [r["policy"] for r in rows] == ["full", "snapkv"]
  for r in rows:
    assert r["mesh"] == "model:3" and r["kv_bytes_per_device"] * 3 == r["kv_bytes"]
  assert rows[0]["correct"]  # the full cache answers this prompt, as on one device
  bad = subprocess.run(args + ["--mesh=data:3", f"--out={tmp_path}/b"], env=env,
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith("error: --mesh data:3: the eval runs "
                                                         "one sample at a time")


@pytest.mark.slow  # loads and compiles SmolLM2 for a prompt run
def test_bench_cli_reports_kv_bytes_per_device(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3",
             JAX_PLATFORMS="cpu")
  done = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", "--policies=snapkv", "--budget=128",
       "--context_lengths=512", "--decode_steps=2", "--repeats=1", "--noisolate",
       "--mesh=model:3", f"--out={tmp_path}"], env=env, capture_output=True, text=True,
      timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert row["mesh"] == "model:3" and row["fill"] == "prompt"
  assert row["kv_bytes_per_device"] * 3 == row["kv_bytes"]


# ------------------------------------------------------------------- in-process checks

@pytest.mark.parametrize("shape, message", [
    ("data:2", "needs 2 devices, there are 1"),
    ("data:1,modle:1", "mesh axes are 'data' and 'model'"),
    ("data:0", "must be a positive int"),
    ((1, 1, 1), "two axes"),
    ("data:-1,model:-1", "at most one"),
])
def test_bad_mesh_shapes_are_refused(shape, message):
  with pytest.raises(ValueError, match=message):
    kvjax.sharding.make_mesh(shape)


def test_mesh_shapes_parse():
  for shape in ("data:1,model:1", {"model": 1}, (1, -1), None):
    mesh = kvjax.sharding.make_mesh(shape)
    assert mesh.axis_names == ("data", "model") and mesh_lib.mesh_sizes(mesh) == (1, 1)


def test_a_mesh_that_does_not_split_the_model_is_refused():
  devices = np.array(jax.devices() * 2, dtype=object)  # sizes only: never run
  config = kvjax.LlamaConfig(**dict(RANDOM, num_kv_heads=3, num_heads=6))
  mesh = jax.sharding.Mesh(devices.reshape(1, 2), ("data", "model"))
  with pytest.raises(ValueError, match="must divide the model's KV heads, 3"):
    mesh_lib.check_mesh(mesh, config)
  mesh = jax.sharding.Mesh(devices.reshape(2, 1), ("data", "model"))
  with pytest.raises(ValueError, match="must divide the batch of 3"):
    mesh_lib.check_mesh(mesh, kvjax.LlamaConfig(**RANDOM), batch_size=3)
  with pytest.raises(ValueError, match="axes \\('data', 'model'\\)"):
    mesh_lib.check_mesh(jax.sharding.Mesh(devices[:1], ("x",)), config)


def test_generate_refuses_a_mesh_of_other_axes():
  lm = kvjax.init_random(kvjax.LlamaConfig(**dict(RANDOM, vocab_size=64)))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh with axes"):
    kvjax.generate(lm, [[1, 2, 3]], max_new_tokens=2, mesh=mesh)


def test_fused_columns_regroup_by_shard():
  # q: 4 columns, k: 2, v: 2, over 2 shards: shard 0 takes q0 q1 k0 v0.
  np.testing.assert_array_equal(layout._column_order((4, 2, 2), 2), [0, 1, 4, 6, 2, 3, 5, 7])
  np.testing.assert_array_equal(layout._column_order((3, 3), 1), np.arange(6))


def test_capacities_must_match_across_model_shards():
  assert layout.local_capacity(((32, 32, 16, 16),), 1) == ((32, 32, 16, 16),)
  assert layout.local_capacity(((32, 16, 32, 16),), 2) == ((32, 16),)
  with pytest.raises(ValueError, match="differ between model shards"):
    layout.local_capacity(((32, 32, 16, 16),), 2)


if __name__ == "__main__":
  child(json.loads(sys.argv[1]))
