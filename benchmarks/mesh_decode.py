"""Decode ms/step of one generate run per device mesh, side by side in one process.

  python benchmarks/mesh_decode.py [--devices 8] [--out results/mesh_decode.jsonl]

Simulates ``--devices`` CPU devices (XLA's host platform), builds a random
model with 8 KV heads, and runs the same batch of 8 prompts (snapkv at budget
256, then 32 decode steps) on one device and on every (data, model) mesh of
the devices, each after a warm-up, best of 3. On a CPU the simulated devices
share the machine's cores, so the ratios show what the mesh costs in
collectives and per-device programs, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--out", default="results/mesh_decode.jsonl")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={args.devices}")
  import numpy as np
  import kvjax

  config = kvjax.LlamaConfig(name="random-8kv", vocab_size=32000, hidden_size=512, num_layers=8,
                             num_heads=16, num_kv_heads=8, head_dim=64, intermediate_size=1536,
                             max_position_embeddings=4096)
  lm = kvjax.init_random(config, seed=0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, 1024).tolist() for _ in range(8)]
  n = args.devices
  meshes = [None] + [(d, n // d) for d in range(n, 0, -1) if n % d == 0 and 8 % (n // d) == 0]
  rows = []
  for shape in meshes:
    mesh = None if shape is None else kvjax.sharding.make_mesh(shape)
    kwargs = dict(policy="snapkv", budget=256, max_new_tokens=33, stop_ids=[], mesh=mesh)
    kvjax.generate(lm, prompts, **kwargs)  # warm-up: compiles
    stats = [kvjax.generate(lm, prompts, **kwargs).stats for _ in range(3)]
    best = min(stats, key=lambda s: s.decode_ms_per_step)
    rows.append(dict(mesh="one device" if shape is None else f"data:{shape[0]},model:{shape[1]}",
                     decode_ms_per_step=best.decode_ms_per_step,
                     prefill_s=min(s.prefill_s for s in stats), kv_bytes=best.kv_bytes,
                     kv_bytes_per_device=best.kv_bytes_per_device))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  base = rows[0]["decode_ms_per_step"]
  print("| mesh | decode ms/step | vs one device | prefill s | KV MiB per device |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['mesh']} | {r['decode_ms_per_step']:.2f} | {r['decode_ms_per_step'] / base:.2f}x"
          f" | {r['prefill_s']:.2f} | {r['kv_bytes_per_device'] / 2**20:.2f} |")


if __name__ == "__main__":
  main()
