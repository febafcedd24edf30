r"""Answer a long-context question under a KV-cache policy and print the stats.

  python -m kvjax.main                                # 2K-token passkey, full cache
  python -m kvjax.main --context_tokens=4096 --depth=0.3
  python -m kvjax.main --prompt_file=doc.txt --question="Who wrote it?"

Flags pick the model, the prompt (a generated passkey haystack, or your own
text and question), the policy and budget, and the decoding length.
"""

from __future__ import annotations

import logging
import pathlib
import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_integer("context_tokens", 2048, "Length of the generated passkey prompt, in tokens.")
flags.DEFINE_float("depth", 0.5, "Where the passkey sits in the haystack (0 = start, 1 = end).")
flags.DEFINE_integer("seed", 0, "Seed of the passkey and of sampling.")
flags.DEFINE_string("prompt_file", None, "A text file to use as the context instead of the passkey haystack.")
flags.DEFINE_string("question", None, "The question asked after --prompt_file's text.")
flags.DEFINE_string("policy", "full", "KV-cache policy, name[:field=value...] as in the "
                    "evaluation's --policies (see kvjax.policies.names()).")
flags.DEFINE_integer("budget", None, "KV entries kept per (layer, KV head); none for 'full'.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 for greedy decoding.")
flags.DEFINE_integer("page_size", 16, "Slots per cache page.")
flags.DEFINE_enum("backend", "auto", ["auto", "xla", "pallas", "native"], "Paged attention implementation.")
flags.DEFINE_bool("scan_layers", None, "Stacked layers under lax.scan; --noscan_layers gives each "
                  "layer its own weights and unrolls them: faster decode steps, slower compilation "
                  "(default: scanned on CPU, unrolled on GPU and TPU).")
flags.DEFINE_bool("packed", False, "Keep a GGUF model's Q4_1 / Q8_0 matrices as their blocks "
                  "(the same weights, read in place by the products; see kvjax.load).")

# What --help lists, by group.
HELP_GROUPS = (
    ("what to run", ("model", "packed", "scan_layers", "policy", "budget", "backend",
                     "page_size")),
    ("prompt", ("context_tokens", "depth", "prompt_file", "question")),
    ("generation", ("max_new_tokens", "temperature", "seed")),
)


class UsageError(Exception):
  """A bad flag or input: printed on one line, exit code 2."""


def _prompt(lm):
  from kvjax import tasks
  if FLAGS.prompt_file:
    path = pathlib.Path(FLAGS.prompt_file)
    if not path.is_file():
      raise UsageError(f"--prompt_file {path} does not exist")
    if not FLAGS.question:
      raise UsageError("--prompt_file needs --question")
    content = f"{path.read_text(errors='replace')}\n\n{FLAGS.question}"
    return lm.tokenizer.chat([{"role": "user", "content": content}]), None
  sample = tasks.passkey_prompt(lm.tokenizer, context_tokens=FLAGS.context_tokens,
                                depth=FLAGS.depth, seed=FLAGS.seed)
  return sample.prompt, sample.answer


def _run() -> None:
  import kvjax
  from kvjax.eval import policy_entries
  try:
    try:
      policy = policy_entries.parse(FLAGS.policy).make(window=0)
    except ValueError as e:  # the evaluation's words for its --policies entries
      raise UsageError(str(e).replace("--policies entry", "--policy")) from None
    lm = kvjax.load(FLAGS.model, scan_layers=FLAGS.scan_layers, packed=FLAGS.packed)
    prompt, answer = _prompt(lm)
    result = kvjax.generate(
        lm, [prompt], policy=policy, budget=FLAGS.budget,
        max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, seed=FLAGS.seed,
        page_size=FLAGS.page_size, backend=FLAGS.backend)
  except ValueError as e:
    raise UsageError(str(e)) from None
  s = result.stats
  print(f"model        {lm.config.name} ({lm.source})")
  print(f"prompt       {s.prompt_tokens[0]} tokens")
  print(f"answer       {result.texts[0].strip()!r}")
  if answer is not None:
    print(f"expected     {answer!r}  ({'correct' if answer in result.texts[0] else 'wrong'})")
  print(f"policy       {s.policy}, budget {s.budget}, backend {s.backend}, layers "
        f"{'scanned' if lm.scan_layers else 'unrolled'}{', packed weights' if lm.packed else ''}")
  print(f"kv cache     {s.kv_bytes / 2**20:.1f} MiB allocated")
  print(f"prefill      {s.prefill_s:.3f} s ({s.prompt_tokens[0] / s.prefill_s:.0f} tokens/s)")
  print(f"decode       {s.generated_tokens[0]} tokens in {s.decode_s:.3f} s "
        f"({s.decode_tokens_per_s:.1f} tokens/s, {s.decode_ms_per_step:.1f} ms/step)")
  print(f"compile      {s.compile_s:.1f} s")


def main(argv) -> None:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  # absl shows INFO logs; JAX's note about absent TPU/GPU backends is noise here.
  logging.getLogger("jax").setLevel(logging.WARNING)
  try:
    _run()
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run() -> None:
  """Console-script entry point, run as the other tools are (``kvjax.cli.run``: the process
  set up by ``kvjax.runtime``, bad flags and unusable native kernels on one line, exit 2)."""
  from kvjax import cli
  cli.run(main, HELP_GROUPS)


if __name__ == "__main__":
  run()
