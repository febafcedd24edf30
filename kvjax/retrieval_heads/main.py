r"""Trains the DuoAttention gates of a model (which KV heads are retrieval heads) and saves them.

  python -m kvjax.retrieval_heads                  # SmolLM2-135M, the defaults (minutes on a CPU)
  python -m kvjax.retrieval_heads --model=smollm2-135m-instruct --steps=80 \
      --out=docs/results/retrieval_heads --gates=kvjax/retrieval_heads/gates/smollm2-135m-instruct

Writes the gates with orbax to --gates (default --out/gates), --out/losses.jsonl
(step, loss, mse, seconds) and --out/loss_curve.png, and prints the gates
table and the wall time. kvjax.retrieval_heads.train has the method.

A bad flag or input ends in one line ``error: ...`` (exit 2).
"""

from __future__ import annotations

from absl import flags

from kvjax import cli
from kvjax.retrieval_heads import report

_D = report.TrainConfig()
FLAGS = flags.FLAGS
flags.DEFINE_string("model", _D.model, "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_integer("steps", _D.steps, "Adam steps, one batch each.")
flags.DEFINE_float("learning_rate", _D.learning_rate, "Adam's learning rate.")
flags.DEFINE_integer("length", _D.length, "Tokens per training prompt.")
flags.DEFINE_integer("batch_size", _D.batch_size, "Prompts per step.")
flags.DEFINE_integer("n_sink", _D.n_sink, "Streaming attention's first tokens.")
flags.DEFINE_integer("recent", _D.recent, "Streaming attention's recent tokens.")
flags.DEFINE_float("l1", _D.l1, "Weight of mean(|gates|) in the loss (the pull to streaming).")
flags.DEFINE_integer("seed", _D.seed, "Seed of the training prompts.")
flags.DEFINE_string("out", "results/retrieval_heads", "Folder of losses.jsonl and the plot.")
flags.DEFINE_string("gates", "", "The gates' orbax folder; empty: --out/gates.")
flags.DEFINE_bool("progress", True, "A progress bar on stderr.")


def main(argv) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  cli.quiet_logs()
  cli.check_out_folder(FLAGS.out)
  # Bad input (ValueError, OSError) ends in one line in cli.call.
  cfg = report.TrainConfig(model=FLAGS.model, steps=FLAGS.steps,
                           learning_rate=FLAGS.learning_rate, length=FLAGS.length,
                           batch_size=FLAGS.batch_size, n_sink=FLAGS.n_sink,
                           recent=FLAGS.recent, l1=FLAGS.l1, seed=FLAGS.seed)
  try:
    result = report.train_and_save(cfg, FLAGS.out, FLAGS.gates or None,
                                   progress=FLAGS.progress)
  except KeyboardInterrupt:
    cli.interrupted("interrupted; no gates written")
  print(result["text"])
  print(f"gates in {result['gates_dir']}; losses.jsonl and loss_curve.png in {FLAGS.out}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main)


if __name__ == "__main__":
  run()
