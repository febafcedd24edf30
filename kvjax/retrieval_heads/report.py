"""One training run end to end: load the model, train the gates, save them, report.

``train_and_save`` is what ``python -m kvjax.retrieval_heads`` calls. It writes

  <gates folder>        the orbax checkpoint (``gates_io.save_gates``)
  <out>/losses.jsonl    one row a step: step, loss, mse (its squared-error part), seconds
  <out>/loss_curve.png  the loss by step, and the gates [L, K] as an image

and returns a summary whose ``text`` is the gates table and the wall time.

Dimension letters: L layers, K KV heads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

import numpy as np

from kvjax import plots
from kvjax.retrieval_heads import gates_io
from kvjax.retrieval_heads import train


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A gate-training run (the CLI's flags)."""

  model: str = "smollm2-135m-instruct"  # registry name, .gguf path or safetensors folder
  steps: int = train.STEPS  # Adam steps, one batch each
  learning_rate: float = train.LEARNING_RATE  # Adam's rate
  length: int = train.LENGTH  # tokens per training prompt
  batch_size: int = train.BATCH_SIZE  # prompts per step
  n_sink: int = train.N_SINK  # streaming attention's first tokens
  recent: int = train.RECENT  # streaming attention's recent tokens, the query's own included
  l1: float = train.L1  # weight of mean(|gates|) in the loss
  seed: int = train.SEED  # seeds the training prompts

  def __post_init__(self):
    train.check_settings(steps=self.steps, learning_rate=self.learning_rate,
                         length=self.length, batch_size=self.batch_size, n_sink=self.n_sink,
                         recent=self.recent, l1=self.l1, seed=self.seed)


def gates_table(gates: np.ndarray, layers=None) -> str:
  """A markdown table of gates [L, K]: one row a layer (numbered by ``layers``,
  default 0..L-1), one column a KV head."""
  gates = np.asarray(gates)
  heads = range(gates.shape[1])
  layers = range(len(gates)) if layers is None else layers
  lines = ["| layer | " + " | ".join(f"kv {k}" for k in heads) + " |",
           "|---:|" + "---:|" * gates.shape[1]]
  lines += [f"| {i} | " + " | ".join(f"{g:.3f}" for g in row) + " |"
            for i, row in zip(layers, gates)]
  return "\n".join(lines)


def write_losses(path: pathlib.Path, rows: list[dict[str, Any]]) -> pathlib.Path:
  """Writes one JSON object a line."""
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


def plot(path: pathlib.Path, rows: list[dict[str, Any]], gates: np.ndarray,
         title: str, layers=None) -> pathlib.Path:
  """The loss (and its squared-error part) by step, beside the gates [L, K] as an
  image (its columns numbered by ``layers``, default 0..L-1)."""
  fig, (curve, image) = plots.panels(2, 5.0, 3.8)
  steps = [r["step"] for r in rows]
  curve.plot(steps, [r["loss"] for r in rows], label="loss", color="tab:blue")
  curve.plot(steps, [r["mse"] for r in rows], label="squared error", color="tab:orange")
  curve.set_xlabel("step")
  curve.set_ylabel("loss")
  # Linear from 0: the first step's squared error (~0, every gate at 1) would
  # turn a log axis into decades of nothing.
  curve.set_ylim(0, max([r["loss"] for r in rows] + [r["mse"] for r in rows]) * 1.08 or 1.0)
  curve.legend(fontsize=8)
  curve.set_title(title, fontsize=9)
  shown = image.imshow(np.asarray(gates).T, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis",
                       interpolation="nearest")
  image.set_xlabel("layer")
  if layers is not None:
    image.set_xticks(range(len(layers)), [str(l) for l in layers])
  image.set_ylabel("KV head")
  image.set_yticks(range(np.shape(gates)[1]))
  image.set_title("gates (1 = retrieval head, 0 = streaming)", fontsize=9)
  fig.colorbar(shown, ax=image)
  return plots.save(fig, path)


def train_and_save(cfg: TrainConfig, out: str | pathlib.Path,
                   gates_dir: str | pathlib.Path | None = None, *,
                   progress: bool = True) -> dict[str, Any]:
  """Loads ``cfg.model``, trains its gates, saves them and writes the report files.

  Args:
    out: folder of losses.jsonl and loss_curve.png (made if missing).
    gates_dir: the gates' orbax folder; None: ``out``/gates.

  Returns:
    {"gates", "losses", "seconds" (wall time, model load included),
     "gates_dir", "text" (the gates table and the wall time)}.
  """
  # The loader's own module, not the package's facade: a library module below the
  # command-line tools imports no re-export of `kvjax`.
  from kvjax.models import lm as lm_lib  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  gates_dir = out / "gates" if gates_dir is None else pathlib.Path(gates_dir)
  lm = lm_lib.load(cfg.model)
  rows: list[dict[str, Any]] = []

  def on_step(step, loss, mse, seconds):
    rows.append(dict(step=step, loss=loss, mse=mse, seconds=round(seconds, 3)))

  settings = dataclasses.asdict(cfg)
  gates, losses = train.train_gates(
      lm, **{k: v for k, v in settings.items() if k != "model"}, progress=progress,
      on_step=on_step)
  seconds = time.perf_counter() - start
  settings["wall_seconds"] = round(seconds, 1)
  gates_dir = gates_io.save_gates(gates_dir, gates, model=cfg.model, n_sink=cfg.n_sink,
                                  recent=cfg.recent, steps=cfg.steps, losses=losses,
                                  settings=settings)
  write_losses(out / "losses.jsonl", rows)
  layers = lm.config.global_layers
  plot(out / "loss_curve.png", rows, gates,
       f"{cfg.model}: {cfg.steps} steps of {cfg.batch_size} x {cfg.length} tokens", layers)
  text = (f"gates of {cfg.model} (rows: layers, columns: KV heads; 1 = retrieval head):\n"
          f"{gates_table(gates, layers)}\n"
          f"loss {losses[0]:.4g} at the first step, {losses[-1]:.4g} at the last\n"
          f"wall time {seconds:.1f} s ({cfg.steps} steps, model load included)")
  return dict(gates=gates, losses=losses, seconds=seconds, gates_dir=gates_dir, text=text)
