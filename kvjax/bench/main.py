r"""Decode speed, prefill time and memory of KV-cache policies against context length.

  python -m kvjax.bench                                   # full vs policies, 4K-32K
  python -m kvjax.bench --policies=full,snapkv,paged_eviction --budget=1024 \
      --context_lengths=8192,16384,32768,65536,131072 --decode_steps=16
  python -m kvjax.bench --policies=full,snapkv --context_lengths=8000 --prefill_chunk=512
  python -m kvjax.bench ... --compilation_cache=~/.cache/kvjax/xla   # twice: the second
                                                 # run loads its programs, compiles none
  python -m kvjax.bench --preset=accelerator   # a GPU/TPU against its physical floor
                                                 # (kvjax/bench/accelerator/)

Each (policy, context length) runs in a fresh child process (``--isolate``), so
its peak memory is its own. Lengths that fit the model's context run a real
prompt (prefill timed); longer ones fill the cache with synthetic keys and
values (said in each row's ``fill``). Writes --out/results.jsonl (this run's
rows), summary.md and PNG plots; prints the summary.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

from absl import flags

from kvjax import cli
from kvjax.bench import accelerator
from kvjax.bench import report
from kvjax.bench import runner

_D = runner.BenchConfig()
FLAGS = flags.FLAGS
flags.DEFINE_string("model", _D.model, "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_list("policies", ["full", "snapkv", "streaming_llm", "paged_eviction"],
                  "Policies; 'full' is the uncompressed reference.")
flags.DEFINE_integer("budget", 1024, "KV entries per (layer, KV head) for every policy but full.")
flags.DEFINE_list("context_lengths", ["4096", "8000", "16384", "32768"],
                  "Cache lengths in tokens before decoding.")
flags.DEFINE_integer("batch_size", _D.batch_size, "Sequences decoded together.")
flags.DEFINE_integer("decode_steps", _D.decode_steps, "Decode steps timed per run.")
flags.DEFINE_integer("prefill_chunk", _D.prefill_chunk, "Chunked prefill (0 = one shot).")
flags.DEFINE_enum("backend", _D.backend, ["auto", "xla", "pallas", "native"], "Kernel backend.")
flags.DEFINE_enum("fill", _D.fill, ["auto", "prompt", "synthetic"],
                  "How the cache is filled: a real prompt, synthetic entries, or auto "
                  "(a prompt where it fits the model's context).")
flags.DEFINE_integer("repeats", _D.repeats, "Timed runs after the warm-up (the best counts).")
flags.DEFINE_integer("window", _D.window, "Observation window of window-scored policies.")
flags.DEFINE_bool("scan_layers", _D.scan_layers,
                  "Stacked layers under lax.scan; --noscan_layers gives each layer its own "
                  "weights and unrolls them: faster decode steps, slower compilation.")
flags.DEFINE_bool("packed", _D.packed,
                  "Keep a GGUF model's Q4_1 / Q8_0 matrices as their blocks (the same weights, "
                  "read in place by the products; see kvjax.load).")
flags.DEFINE_string("compilation_cache", None,
                    "Folder of JAX's persistent compilation cache: programs an earlier run "
                    "compiled are loaded from it, not compiled, so a row's peak memory is "
                    "that of running, without the compiler's (run the bench twice; each "
                    "row counts its programs_compiled and programs_from_cache).")
flags.DEFINE_bool("isolate", True, "Run each configuration in its own process (own peak memory).")
flags.DEFINE_string("out", "results/bench", "Output folder (results/accelerator with --preset).")
flags.DEFINE_enum("preset", None, ["accelerator"],
                  "accelerator: kernel bytes/s, decode ms/step, throughput, prefill and "
                  "pallas-vs-xla tokens on the random Llama-3.2-1B shape against the chip's "
                  "floor (kvjax/bench/accelerator/); of the other flags it reads only "
                  "--out, --scale, --sections and --[no]scan_layers (when given; else the "
                  "device's default layout).")
flags.DEFINE_enum("scale", "auto", ["auto", "full", "small"],
                  "With --preset: full sizes, or toy ones (a plumbing check); auto: small "
                  "on CPU, full on a GPU/TPU.")
flags.DEFINE_list("sections", list(accelerator.SECTIONS), "With --preset: the sections to run.")
flags.DEFINE_string("child", None, "Internal: run one configuration (JSON) and print its row.")

_ROW = "KVJAX_BENCH_ROW "


def _ints(name: str) -> list[int]:
  try:
    values = [int(x) for x in getattr(FLAGS, name)]
  except ValueError:
    raise ValueError(f"--{name} must be a comma list of ints, got "
                     f"{','.join(getattr(FLAGS, name))!r}") from None
  if not values or min(values) < 1:
    raise ValueError(f"--{name} must be positive ints, got {values}")
  return values


def configs() -> list[runner.BenchConfig]:
  """The run's configurations, from the flags (ValueError for a bad value)."""
  from kvjax import policies
  for name in FLAGS.policies:
    policies.get(name)
  for name in ("batch_size", "decode_steps", "repeats", "budget"):
    if getattr(FLAGS, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.prefill_chunk < 0:
    raise ValueError(f"--prefill_chunk must be >= 0, got {FLAGS.prefill_chunk}")
  cache_dir = FLAGS.compilation_cache and str(
      pathlib.Path(FLAGS.compilation_cache).expanduser().resolve())
  return [runner.BenchConfig(
      model=FLAGS.model, policy=p, budget=None if p == "full" else FLAGS.budget,
      context_length=n, batch_size=FLAGS.batch_size, decode_steps=FLAGS.decode_steps,
      prefill_chunk=FLAGS.prefill_chunk if p != "full" else 0, backend=FLAGS.backend,
      fill=FLAGS.fill, repeats=FLAGS.repeats, window=FLAGS.window,
      scan_layers=FLAGS.scan_layers, packed=FLAGS.packed,
      compilation_cache=cache_dir)
      for n in _ints("context_lengths") for p in FLAGS.policies]


def _in_child(cfg: runner.BenchConfig) -> dict:
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", f"--child={json.dumps(dataclasses.asdict(cfg))}"],
      capture_output=True, text=True)
  rows = [l[len(_ROW):] for l in proc.stdout.splitlines() if l.startswith(_ROW)]
  if proc.returncode != 0 or not rows:
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise RuntimeError(f"{cfg.policy} at {cfg.context_length} tokens failed: {tail}")
  return json.loads(rows[-1])


def main(argv) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  cli.quiet_logs()
  if FLAGS.child:  # one configuration, in this (fresh) process
    print(_ROW + json.dumps(runner.measure(runner.BenchConfig(**json.loads(FLAGS.child)))))
    return
  if FLAGS.preset == "accelerator":
    unknown = sorted(set(FLAGS.sections) - set(accelerator.SECTIONS))
    if unknown:
      cli.fail(f"--sections: unknown {unknown}; known: {','.join(accelerator.SECTIONS)}")
    out = FLAGS.out if FLAGS["out"].present else "results/accelerator"
    accelerator.run(out, scale=FLAGS.scale, sections=FLAGS.sections,
                    scan_layers=FLAGS.scan_layers if FLAGS["scan_layers"].present else None)
    print(f"rows and summary.md in {out}")
    return
  try:
    todo = configs()
  except ValueError as e:
    cli.fail(str(e))
  from tqdm import tqdm
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  rows, lm = [], None
  with (out / "results.jsonl").open("w") as f:
    for cfg in tqdm(todo, desc="bench", unit="config", file=sys.stderr):
      try:
        if FLAGS.isolate:
          row = _in_child(cfg)
        else:
          if lm is None:
            import kvjax
            lm = kvjax.load(cfg.model, scan_layers=cfg.scan_layers, packed=cfg.packed)
          row = runner.measure(cfg, lm)
      except (ValueError, RuntimeError) as e:
        cli.fail(str(e))
      f.write(json.dumps(row) + "\n")
      f.flush()
      rows.append(row)
  print(report.write_report(rows, out))
  print(f"rows, summary.md and plots in {out}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main)


if __name__ == "__main__":
  run()
