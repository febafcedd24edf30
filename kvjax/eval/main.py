r"""Accuracy of KV-cache policies at budgets on NIAH/RULER-style tasks or a local dataset.

  python -m kvjax.eval                          # the default run (a few minutes on a CPU)
  python -m kvjax.eval --policies=full,snapkv,sablock --budgets=128,256,512 \
      --lengths=1024,2048,4096,8192 --depths=0.1,0.3,0.5,0.7,0.9 --out=results/niah
  python -m kvjax.eval --task=dataset --dataset=ruler_4k.jsonl --metric=contains
  python -m kvjax.eval --policies=full,paged_eviction,paged_eviction:candidates=3 \
      --budgets=128,256                         # one policy twice: its default and a variant

Every policy runs at its own defaults (docs/policies.md lists them). An entry
of --policies may set fields of its own, name:field=value[:field=value...]
(ints, floats, true/false, text); --window, when nonzero, sets the observation
window (H2O: recent window) of every policy that has one, and an entry's own
fields win over it. A budget must exceed what a policy always keeps (its sinks
and window).

Writes --out/results.jsonl (one row per sample × policy entry × budget, each
with the fields set explicitly, ``policy_fields``, and every setting the policy
ran with, ``policy_settings``; a rerun skips the rows already there),
--out/summary.md (its tables label a row ``name (field=value, ...)`` and end
with every row's settings) and PNG plots, and prints the summary.
"""

from __future__ import annotations

import pathlib

from absl import flags

from kvjax import cli
from kvjax.eval import runner

_D = runner.EvalConfig()
FLAGS = flags.FLAGS
flags.DEFINE_string("model", _D.model, "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_list("policies", list(_D.policies),
                  "Policies to compare (kvjax.policies.names()), each at its own defaults; an "
                  "entry may set fields of its own, name:field=value[:field=value...], e.g. "
                  "paged_eviction:candidates=3 (one policy may appear twice, with other fields).")
flags.DEFINE_list("budgets", [str(b) for b in _D.budgets],
                  "KV entries kept per (layer, KV head), sinks and window included.")
flags.DEFINE_enum("task", _D.task, list(runner.TASKS), "Task; 'dataset' reads --dataset.")
flags.DEFINE_list("haystacks", list(_D.haystacks), "Filler kinds of synthetic tasks: repeat, natural.")
flags.DEFINE_list("lengths", [str(n) for n in _D.lengths], "Prompt lengths in tokens (synthetic tasks).")
flags.DEFINE_list("depths", [str(d) for d in _D.depths], "Needle depths, fractions of the haystack.")
flags.DEFINE_integer("num_samples", _D.num_samples,
                     "Samples per (length, depth, haystack), or dataset rows to use; 0 = 1 / all.")
flags.DEFINE_integer("seed", _D.seed, "Seed of the synthetic prompts.")
flags.DEFINE_bool("query_aware", _D.query_aware,
                  "Compress the question with the context (else compress, then ask).")
flags.DEFINE_integer("window", _D.window, "Observation window of every policy that has one "
                     "(H2O: its recent window); 0 = each policy's own default. Fields an "
                     "entry of --policies sets win over it.")
flags.DEFINE_integer("prefill_chunk", _D.prefill_chunk,
                     "Prefill in chunks of this many tokens, compressing after each; 0 = one shot.")
flags.DEFINE_enum("backend", _D.backend, ["auto", "xla", "pallas", "native"], "Kernel backend.")
flags.DEFINE_integer("max_new_tokens", _D.max_new_tokens,
                     "Tokens to generate; 0 = the task's own (32 for dataset rows without one).")
flags.DEFINE_string("dataset", None, "A local .jsonl or .parquet file in kvpress's schema "
                    "(context, question, answer[, answer_prefix, max_new_tokens, id]).")
flags.DEFINE_string("metric", _D.metric, "contains, qa_f1, rouge_l, classification, retrieval, "
                    "code_sim, or auto (contains for synthetic tasks, qa_f1 for datasets).")
flags.DEFINE_bool("packed", _D.packed, "Keep a GGUF model's Q4_1 / Q8_0 matrices as their "
                  "blocks (the same weights, read in place by the products; see kvjax.load).")
flags.DEFINE_string("mesh", _D.mesh, "A device mesh for the KV heads, e.g. model:3 "
                    "(docs/sharding.md); empty: one device.")
flags.DEFINE_string("out", "results/eval", "Output folder.")


# What --help lists, by group.
HELP_GROUPS = (
    ("what to run", ("model", "packed", "policies", "budgets", "backend", "mesh")),
    ("prompts", ("task", "dataset", "haystacks", "lengths", "depths", "num_samples", "seed")),
    ("generation", ("query_aware", "window", "prefill_chunk", "max_new_tokens")),
    ("scoring and output", ("metric", "out")),
)
UsageError = cli.UsageError


def _numbers(name: str, kind):
  try:
    return tuple(kind(x) for x in getattr(FLAGS, name))
  except ValueError:
    raise UsageError(f"--{name} must be a comma list of {kind.__name__}s, "
                     f"got {','.join(getattr(FLAGS, name))!r}") from None


def config_from_flags() -> runner.EvalConfig:
  """The run the flags describe (UsageError for a bad value).

  Beyond EvalConfig's own checks: a budget above every synthetic prompt
  length would keep whole prompts (nothing compressed, nothing measured).
  """
  try:
    cfg = runner.EvalConfig(
        model=FLAGS.model, policies=tuple(FLAGS.policies), budgets=_numbers("budgets", int),
        task=FLAGS.task, haystacks=tuple(FLAGS.haystacks), lengths=_numbers("lengths", int),
        depths=_numbers("depths", float), num_samples=FLAGS.num_samples, seed=FLAGS.seed,
        query_aware=FLAGS.query_aware, window=FLAGS.window, prefill_chunk=FLAGS.prefill_chunk,
        backend=FLAGS.backend, max_new_tokens=FLAGS.max_new_tokens, dataset=FLAGS.dataset,
        metric=FLAGS.metric, packed=FLAGS.packed, mesh=FLAGS.mesh)
  except ValueError as e:
    raise UsageError(str(e)) from None
  compressed = [str(e) for e in cfg.entries() if e.name != "full"]
  if cfg.task != "dataset" and compressed and cfg.budgets and cfg.lengths:
    if max(cfg.budgets) >= max(cfg.lengths):
      raise UsageError(f"--budgets {max(cfg.budgets)} is not below the longest of --lengths "
                       f"({max(cfg.lengths)}): {compressed[0]} would keep whole prompts")
  return cfg


def _rows_kept(out: str) -> int:
  """Complete rows in ``out``/results.jsonl (what a rerun reuses)."""
  from kvjax.eval import results
  try:
    return len(results.read_rows(pathlib.Path(out) / "results.jsonl").rows)
  except (OSError, ValueError):
    return 0


def main(argv) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  cli.quiet_logs()
  from kvjax.eval import report
  cfg = config_from_flags()
  cli.check_out_folder(FLAGS.out)
  cli.check_backend(cfg.backend)
  try:
    rows = runner.run(cfg, FLAGS.out)
  except KeyboardInterrupt:
    cli.interrupted(f"interrupted; {_rows_kept(FLAGS.out)} rows kept in {FLAGS.out}, "
                    "rerun to resume")
  except runner.EvalError as e:  # names the sample and its runs, and the cause's type
    cli.fail(e)
  # Bad input found before any work (unknown policy or model, a budget a policy
  # cannot honour, an unreadable dataset: ValueError, OSError) ends in cli.call.
  print(report.write_report(rows, FLAGS.out))
  print(f"rows, summary.md and plots in {FLAGS.out}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main, HELP_GROUPS)


if __name__ == "__main__":
  run()
