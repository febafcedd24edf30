r"""Decode speed, prefill time and memory of KV-cache policies against context length.

  python -m kvjax.bench                                   # full vs policies, 4K-32K
  python -m kvjax.bench --policies=full,snapkv,paged_eviction --budget=1024 \
      --context_lengths=8192,16384,32768,65536,131072 --decode_steps=16
  python -m kvjax.bench --policies=full,snapkv --context_lengths=8000 --prefill_chunk=512
  python -m kvjax.bench ... --compilation_cache=~/.cache/kvjax/xla   # twice: the second
                                                 # run loads its programs, compiles none
  python -m kvjax.bench --preset=accelerator   # a GPU/TPU against its physical floor
                                                 # (kvjax/bench/accelerator/)
  python -m kvjax.bench --preset=serving --serving_policies=full,snapkv:512,sablock:512 \
      --serving_prompt_tokens=4096 --serving_pool=4   # requests arriving at an engine
                                                 # (kvjax/bench/serving.py)
  python -m kvjax.bench --policies=full,paged_eviction,paged_eviction:candidates=3

Every policy runs at its own defaults. An entry of --policies may set fields
of its own, name:field=value[:field=value...] (ints, floats, true/false,
text; kvjax.eval.policy_entries), and --window, when nonzero, sets the
observation window (H2O: recent window) of every policy that has one; an
entry's own fields win over it. Each row records the fields set explicitly
(``policy_fields``) and every setting the policy ran with
(``policy_settings``); the summary labels a policy ``name (field=value, ...)``
and ends with each one's settings.

Each (policy, context length) runs in a fresh child process (``--isolate``), so
its peak memory is its own. Lengths that fit the model's context run a real
prompt (prefill timed); longer ones fill the cache with synthetic keys and
values (said in each row's ``fill``). Writes --out/results.jsonl (this run's
rows), summary.md and PNG plots; prints the summary.

Before running anything, every configuration is checked: the flags' ranges,
the output folder (writable), a prompt that fits the model, a budget the
policy honours, and memory: weights + KV cache + activations, estimated
(kvjax/bench/memory.py, each row's ``estimated_bytes``) against the device's
memory. A run that fails or is interrupted leaves an earlier run's
results.jsonl, summary.md and plots as they were; its own rows so far are in
results.partial.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from absl import flags

from kvjax import cli
from kvjax.bench import accelerator
from kvjax.bench import memory
from kvjax.bench import report
from kvjax.bench import runner
from kvjax.bench import serving
from kvjax.eval import policy_entries

_D = runner.BenchConfig()
FLAGS = flags.FLAGS
flags.DEFINE_string("model", _D.model, "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_list("policies", ["full", "snapkv", "streaming_llm", "paged_eviction"],
                  "Policies, each at its own defaults; 'full' is the uncompressed reference. An "
                  "entry may set fields of its own, name:field=value[:field=value...], e.g. "
                  "paged_eviction:candidates=3 (one policy may appear twice, with other fields).")
flags.DEFINE_integer("budget", 1024, "KV entries per (layer, KV head) for every policy but full.")
flags.DEFINE_list("context_lengths", ["4096", "8000", "16384", "32768"],
                  "Cache lengths in tokens before decoding.")
flags.DEFINE_integer("batch_size", _D.batch_size, "Sequences decoded together.")
flags.DEFINE_integer("decode_steps", _D.decode_steps, "Decode steps timed per run.")
flags.DEFINE_integer("prefill_chunk", _D.prefill_chunk, "Chunked prefill (0 = one shot).")
flags.DEFINE_string("mesh", _D.mesh, "A device mesh, e.g. data:2,model:4 (sequences over data, "
                    "KV heads over model; docs/sharding.md); empty: one device.")
flags.DEFINE_enum("backend", _D.backend, ["auto", "xla", "pallas", "native"], "Kernel backend.")
flags.DEFINE_enum("fill", _D.fill, ["auto", "prompt", "synthetic"],
                  "How the cache is filled: a real prompt, synthetic entries, or auto "
                  "(a prompt where it fits the model's context).")
flags.DEFINE_integer("repeats", _D.repeats, "Timed runs after the warm-up (the best counts).")
flags.DEFINE_integer("window", _D.window, "Observation window of every policy that has one "
                     "(H2O: its recent window); 0 = each policy's own default. Fields an "
                     "entry of --policies sets win over it.")
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
flags.DEFINE_enum("preset", None, ["accelerator", "serving"],
                  "accelerator: kernel bytes/s, decode ms/step, throughput, prefill and "
                  "pallas-vs-xla tokens on the random Llama-3.2-1B shape against the chip's "
                  "floor (kvjax/bench/accelerator/); of the other flags it reads only "
                  "--out, --scale, --sections, --config and --[no]scan_layers (when given; "
                  "else the device's default layout). serving: task prompts arriving at "
                  "the serving engine, one pool for every --serving_policies entry "
                  "(kvjax/bench/serving.py); it reads the --serving_* flags, --kv_memory, "
                  "--model, --packed, --scan_layers, --backend, --mesh, --window, "
                  "--prefill_chunk (when given; else 512) and --out (else results/serving).")
flags.DEFINE_enum("scale", "auto", ["auto", "full", "small"],
                  "With --preset: full sizes, or toy ones (a plumbing check); auto: small "
                  "on CPU, full on a GPU/TPU.")
flags.DEFINE_list("sections", list(accelerator.SECTIONS), "With --preset: the sections to run.")
flags.DEFINE_string("config", None, "With --preset: a config file (get_config(), as in configs/) "
                    "whose model shape the decode, throughput and prefill sections use "
                    "instead of the shipped Llama-3.2-1B one.")
flags.DEFINE_list("serving_policies", ["full", "snapkv:512", "sablock:512"],
                  "With --preset=serving: the configurations, name[:budget][:field=value...] "
                  "('full' takes no budget), e.g. full,snapkv:512,sablock:512:window=8.")
flags.DEFINE_integer("serving_requests", 16, "With --preset=serving: requests in the workload.")
flags.DEFINE_float("serving_rate", float("inf"),
                   "With --preset=serving: Poisson arrivals, requests per second; inf: all "
                   "at once.")
flags.DEFINE_enum("serving_task", "passkey", list(serving.TASKS),
                  "With --preset=serving: the prompts' task (passkey: a pass key in "
                  "repeated filler; niah: a magic number in natural text), scored with its "
                  "metric.")
flags.DEFINE_integer("serving_prompt_tokens", 4096,
                     "With --preset=serving: each task prompt's length in tokens.")
flags.DEFINE_integer("serving_max_tokens", 0, "With --preset=serving: new tokens per request "
                     "at most; 0: the task's own.")
flags.DEFINE_bool("serving_ignore_eos", False, "With --preset=serving: every request "
                  "generates --serving_max_tokens, past the tokenizer's stop ids (as vLLM's "
                  "benchmark's --ignore-eos): output lengths the same for every policy.")
flags.DEFINE_float("serving_pool", 4.0,
                   "With --preset=serving: the page pool, as this many full-cache requests "
                   "of the longest kind (the same pool for every configuration).")
flags.DEFINE_string("kv_memory", None, "With --preset=serving: the page pool in bytes "
                    "(e.g. 2GiB) instead of --serving_pool.")
flags.DEFINE_integer("serving_max_slots", 8,
                     "With --preset=serving: requests running at once at most.")
flags.DEFINE_integer("serving_steps_per_dispatch", 8,
                     "With --preset=serving: decode steps per dispatch.")
flags.DEFINE_integer("serving_seed", 0,
                     "With --preset=serving: the prompts' and the arrivals' seed.")
flags.DEFINE_string("child", None, "Internal: run one configuration (JSON) and print its row.")

# What --help lists, by group.
HELP_GROUPS = (
    ("what to run", ("model", "packed", "scan_layers", "policies", "budget", "backend", "mesh")),
    ("cache and decoding", ("context_lengths", "fill", "batch_size", "decode_steps",
                            "prefill_chunk", "window")),
    ("measuring", ("repeats", "isolate", "compilation_cache")),
    ("output", ("out",)),
    ("presets", ("preset",)),
    ("accelerator preset", ("scale", "sections", "config")),
    ("serving preset", ("serving_policies", "serving_requests", "serving_rate",
                        "serving_task", "serving_prompt_tokens", "serving_max_tokens",
                        "serving_ignore_eos",
                        "serving_pool", "kv_memory", "serving_max_slots",
                        "serving_steps_per_dispatch", "serving_seed")),
)
_ROW = "KVJAX_BENCH_ROW "
# Rows of a run in progress; replaces results.jsonl when the run completes.
PARTIAL = "results.partial.jsonl"
# Positions are int32: a context plus its new tokens must stay below this.
MAX_POSITIONS = 2**31 - 1


def _ints(name: str) -> list[int]:
  try:
    values = [int(x) for x in getattr(FLAGS, name)]
  except ValueError:
    raise cli.UsageError(f"--{name} must be a comma list of ints, got "
                         f"{','.join(getattr(FLAGS, name))!r}") from None
  if not values or min(values) < 1:
    raise cli.UsageError(f"--{name} must be positive ints, got {values}")
  return values


def configs() -> list[runner.BenchConfig]:
  """The run's configurations, from the flags (UsageError for a bad value).

  Checks what the flags say alone: names, counts and ranges. What needs the
  model (a prompt that fits its context, a budget a policy honours, memory)
  is ``check_configs``.
  """
  for name in ("batch_size", "decode_steps", "repeats", "budget"):
    if getattr(FLAGS, name) < 1:
      raise cli.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  for name in ("prefill_chunk", "window"):
    if getattr(FLAGS, name) < 0:
      raise cli.UsageError(f"--{name} must be >= 0, got {getattr(FLAGS, name)}")
  try:
    entries = policy_entries.parse_all(FLAGS.policies, FLAGS.window)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  lengths = _ints("context_lengths")
  for n in lengths:
    if n + FLAGS.decode_steps + 1 > MAX_POSITIONS:
      raise cli.UsageError(f"--context_lengths {n} + --decode_steps {FLAGS.decode_steps} "
                           f"exceeds the {MAX_POSITIONS:,} positions a cache can number "
                           "(int32)")
  compressed = [str(e) for e in entries if e.name != "full"]
  if compressed and FLAGS.budget > min(lengths):
    raise cli.UsageError(f"--budget {FLAGS.budget} is above --context_lengths {min(lengths)}: "
                         f"{compressed[0]} would keep the whole context; lower --budget or "
                         "raise the lengths")
  cache_dir = FLAGS.compilation_cache and str(
      pathlib.Path(FLAGS.compilation_cache).expanduser().resolve())
  return [runner.BenchConfig(
      model=FLAGS.model, policy=e.name, entry_fields=e.fields,
      budget=None if e.name == "full" else FLAGS.budget,
      context_length=n, batch_size=FLAGS.batch_size, decode_steps=FLAGS.decode_steps,
      prefill_chunk=FLAGS.prefill_chunk if e.name != "full" else 0, backend=FLAGS.backend,
      fill=FLAGS.fill, repeats=FLAGS.repeats, window=FLAGS.window,
      scan_layers=FLAGS.scan_layers, packed=FLAGS.packed,
      compilation_cache=cache_dir, mesh=FLAGS.mesh)
      for n in lengths for e in entries]


def _describe(cfg: runner.BenchConfig) -> str:
  budget = "" if cfg.budget is None else f" at budget {cfg.budget}"
  return f"{cfg.label}{budget}, {cfg.context_length} tokens, batch {cfg.batch_size}"


def check_configs(todo: list[runner.BenchConfig], lm, available: int | None,
                  source: str) -> dict:
  """Refuses (UsageError) a configuration the model or the device cannot run, before any runs.

  Returns {config: its memory estimate}. ``available``: bytes of the device
  (None: unknown, no memory check), ``source``: where that figure comes from.
  """
  estimates = {}
  for cfg in todo:
    try:
      runner.make_policy(cfg, lm.tokenizer)
      estimate = runner.estimate_memory(cfg, lm)
    except ValueError as e:
      raise cli.UsageError(f"{_describe(cfg)}: {e}") from None
    if available is not None and estimate.total > available:
      parts = ", ".join(f"{name} {memory.human(estimate.parts()[name])}"
                        for name in ("weights", "cache", "activations"))
      raise cli.UsageError(
          f"{_describe(cfg)}, {cfg.decode_steps} decode steps needs an estimated "
          f"{memory.human(estimate.total)} ({parts}), more than the "
          f"{memory.human(available)} of {source}; lower --batch_size, --context_lengths "
          "or --decode_steps (kvjax/bench/memory.py)")
    estimates[cfg] = estimate
  return estimates


def _in_child(cfg: runner.BenchConfig) -> dict:
  proc = subprocess.run(
      [sys.executable, "-m", "kvjax.bench", f"--child={json.dumps(dataclasses.asdict(cfg))}"],
      capture_output=True, text=True)
  rows = [l[len(_ROW):] for l in proc.stdout.splitlines() if l.startswith(_ROW)]
  if proc.returncode != 0 or not rows:
    if proc.returncode < 0:
      reason = f"killed by signal {-proc.returncode} (out of memory?)"
    else:  # the child's own one-line error (kvjax.cli), else its last line
      lines = proc.stderr.strip().splitlines() or ["(no output)"]
      errors = [l for l in lines if l.startswith("error: ")]
      reason = (errors or lines)[-1].removeprefix("error: ")
    raise RuntimeError(reason)
  return json.loads(rows[-1])


def _measure_all(todo: list[runner.BenchConfig], out: pathlib.Path, lm) -> list[dict]:
  """Runs every configuration, writing its rows to ``out``/PARTIAL as they come."""
  from tqdm import tqdm
  rows = []
  with (out / PARTIAL).open("w") as f:
    for cfg in tqdm(todo, desc="bench", unit="config", file=sys.stderr):
      try:
        row = _in_child(cfg) if FLAGS.isolate else runner.measure(cfg, lm)
      except (KeyboardInterrupt, SystemExit):
        raise
      except Exception as e:  # pylint: disable=broad-except
        kind = "" if isinstance(e, RuntimeError) and FLAGS.isolate else f"{type(e).__name__}: "
        cli.fail(f"{_describe(cfg)} failed: {kind}{e} (the earlier results in {out} are "
                 f"untouched; this run's {len(rows)} rows are in {PARTIAL})")
      f.write(json.dumps(row) + "\n")
      f.flush()
      rows.append(row)
  return rows


def _finish(rows: list[dict], out: pathlib.Path) -> str:
  """results.jsonl, summary.md and plots, all of this run: the old report goes first."""
  for name in ("summary.md", *report.PLOTS):
    (out / name).unlink(missing_ok=True)
  os.replace(out / PARTIAL, out / "results.jsonl")
  return report.write_report(rows, out)


def _preset() -> None:
  unknown = sorted(set(FLAGS.sections) - set(accelerator.SECTIONS))
  if unknown:
    cli.fail(f"--sections: unknown {unknown}; known: {','.join(accelerator.SECTIONS)}")
  out = FLAGS.out if FLAGS["out"].present else "results/accelerator"
  cli.check_out_folder(out)
  if FLAGS.config is not None and not os.path.isfile(FLAGS.config):
    cli.fail(f"--config: no file {FLAGS.config}")
  accelerator.run(out, scale=FLAGS.scale, sections=FLAGS.sections,
                  scan_layers=FLAGS.scan_layers if FLAGS["scan_layers"].present else None,
                  config=FLAGS.config)
  print(f"rows and summary.md in {out}")


def _serving_configs() -> list[serving.ServingPolicy]:
  """The serving preset's configurations, its flags checked (UsageError for a bad one)."""
  for name in ("serving_requests", "serving_max_slots", "serving_steps_per_dispatch",
               "serving_prompt_tokens"):
    if getattr(FLAGS, name) < 1:
      raise cli.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  for name in ("serving_max_tokens", "serving_seed", "prefill_chunk", "window"):
    if getattr(FLAGS, name) < 0:
      raise cli.UsageError(f"--{name} must be >= 0, got {getattr(FLAGS, name)}")
  if not FLAGS.serving_rate > 0:  # nan too
    raise cli.UsageError(f"--serving_rate must be > 0 (inf: all at once), got "
                         f"{FLAGS.serving_rate}")
  if not 1 <= FLAGS.serving_pool < float("inf"):
    raise cli.UsageError(f"--serving_pool must be >= 1 (full-cache requests the pool "
                         f"holds), got {FLAGS.serving_pool}")
  if FLAGS.kv_memory is not None:
    from kvjax.serve.requests import parse_bytes
    if FLAGS["serving_pool"].present:
      raise cli.UsageError("give the pool as one of --serving_pool and --kv_memory")
    try:
      parse_bytes(FLAGS.kv_memory)
    except ValueError as e:
      raise cli.UsageError(f"--kv_memory: {e}") from None
  try:
    configs = serving.parse_policies(FLAGS.serving_policies, FLAGS.window)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  for config in configs:
    if config.budget is not None and config.budget >= FLAGS.serving_prompt_tokens:
      raise cli.UsageError(f"--serving_policies {config.label}: budget {config.budget} is "
                           f"not below --serving_prompt_tokens {FLAGS.serving_prompt_tokens} "
                           "(it would keep the whole prompt); lower the budget or raise "
                           "the prompt length")
  return configs


def _serving() -> None:
  """--preset=serving: task prompts replayed against the engine under each configuration."""
  configs = _serving_configs()
  out = cli.check_out_folder(FLAGS.out if FLAGS["out"].present else "results/serving")
  cli.check_backend(FLAGS.backend)
  import kvjax
  from kvjax import sharding
  lm = kvjax.load(FLAGS.model, scan_layers=FLAGS.scan_layers, packed=FLAGS.packed)
  workload = serving.make_workload(
      lm.require_tokenizer("the serving benchmark's task prompts"), task=FLAGS.serving_task,
      count=FLAGS.serving_requests, prompt_tokens=FLAGS.serving_prompt_tokens,
      rate=FLAGS.serving_rate, seed=FLAGS.serving_seed, max_tokens=FLAGS.serving_max_tokens,
      ignore_eos=FLAGS.serving_ignore_eos)
  settings = serving.EngineSettings(
      max_slots=FLAGS.serving_max_slots,
      prefill_chunk=FLAGS.prefill_chunk if FLAGS["prefill_chunk"].present else 512,
      steps_per_dispatch=FLAGS.serving_steps_per_dispatch, backend=FLAGS.backend,
      mesh=sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None)
  pool = (serving.Pool(kv_memory=FLAGS.kv_memory) if FLAGS.kv_memory is not None else
          serving.full_cache_pool(lm, workload, FLAGS.serving_pool, settings))
  try:
    serving.run(lm, configs, workload, pool, settings, out, model=FLAGS.model)
  except KeyboardInterrupt:
    cli.interrupted(f"interrupted; results.jsonl in {out} is untouched (this run's rows so "
                    f"far are in {serving.PARTIAL})")
  print((out / "summary.md").read_text())
  print(f"results.jsonl, summary.md and pages.png in {out}")


def main(argv) -> None:
  """Checks every flag, the output folder and each configuration's memory, then runs them.

  A run writes its rows to results.partial.jsonl and, once every
  configuration has run, replaces results.jsonl, summary.md and the plots
  with its own: a run that fails or is interrupted leaves the previous run's
  files as they were (and its own rows so far in results.partial.jsonl).
  """
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  cli.quiet_logs()
  if FLAGS.child:  # one configuration, in this (fresh) process
    print(_ROW + json.dumps(runner.measure(runner.BenchConfig(**json.loads(FLAGS.child)))))
    return
  if FLAGS.preset == "accelerator":
    _preset()
    return
  if FLAGS.preset == "serving":
    _serving()
    return
  todo = configs()
  out = cli.check_out_folder(FLAGS.out)
  cli.check_backend(FLAGS.backend)
  import kvjax
  available, source = memory.available_bytes()  # before the model takes its share
  lm = kvjax.load(FLAGS.model, scan_layers=FLAGS.scan_layers, packed=FLAGS.packed)
  check_configs(todo, lm, available, source)
  if FLAGS.isolate:
    lm = None  # each child loads its own
  try:
    rows = _measure_all(todo, out, lm)
  except KeyboardInterrupt:
    cli.interrupted(f"interrupted; the earlier results in {out} are untouched (this run's "
                    f"rows so far are in {PARTIAL})")
  print(_finish(rows, out))
  print(f"rows, summary.md and plots in {out}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main, HELP_GROUPS)


if __name__ == "__main__":
  run()
