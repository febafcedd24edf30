"""Trained gates on disk: one orbax checkpoint folder per model, and the ones kvjax ships.

A folder holds two orbax items (``orbax.checkpoint.CompositeCheckpointHandler``):

  gates     {"gates": [L, K] float32}, higher = more of a retrieval head
  metadata  JSON: the model, what the gates were trained with, the losses

``kvjax/retrieval_heads/gates/<model name>/`` holds the gates trained for a
registry model (``shipped_gates_path``); ``python -m kvjax.retrieval_heads``
writes new ones. This module imports nothing of kvjax's models, so the
policies can read gates without loading them.

Dimension letters: L layers, K KV heads.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import numpy as np

from kvjax.cache import checkpoint

FORMAT = 1  # bump when what is saved changes
SHIPPED = pathlib.Path(__file__).resolve().parent / "gates"


def save_gates(path: str | os.PathLike, gates, *, model: str, n_sink: int, recent: int,
               steps: int, losses: Sequence[float],
               settings: dict[str, Any] | None = None) -> pathlib.Path:
  """Writes ``gates`` [L, K] and their metadata to the orbax folder ``path`` (replaced if there).

  Args:
    gates: [L, K] floats in [0, 1].
    model: the model's registry name or path (``load_gates`` checks it).
    n_sink, recent: the streaming attention the gates were trained against.
    steps: training steps; losses: the loss of each.
    settings: other training settings to record (JSON values).

  Returns:
    The folder, absolute.

  Raises:
    ValueError: gates not [L, K] or outside [0, 1].
  """
  gates = np.asarray(gates, np.float32)
  if gates.ndim != 2 or 0 in gates.shape:
    raise ValueError(f"gates must be [L, K], got shape {gates.shape}")
  if not np.all((gates >= 0) & (gates <= 1)):
    raise ValueError(f"gates must be in [0, 1], got [{gates.min()}, {gates.max()}]")
  metadata = dict(format=FORMAT, model=str(model), num_layers=int(gates.shape[0]),
                  num_kv_heads=int(gates.shape[1]), n_sink=int(n_sink), recent=int(recent),
                  steps=int(steps), losses=[float(x) for x in losses],
                  settings=dict(settings or {}))
  path = pathlib.Path(path).expanduser().absolute()
  path.parent.mkdir(parents=True, exist_ok=True)
  ocp, checkpointer = checkpoint.checkpointer()
  with checkpointer:
    checkpointer.save(path, args=ocp.args.Composite(
        gates=ocp.args.StandardSave({"gates": gates}), metadata=ocp.args.JsonSave(metadata)),
                      force=True)
  return path


def load_gates(path: str | os.PathLike, *, model: str | None = None
               ) -> tuple[np.ndarray, dict[str, Any]]:
  """The gates [L, K] float32 and metadata dict saved by ``save_gates`` in ``path``.

  Args:
    model: when given, the name the gates must have been trained for.

  Raises:
    ValueError: no such folder, a folder that is not a complete gates
      checkpoint (truncated, corrupt, another kind), or gates of another model.
  """
  path = pathlib.Path(path).expanduser().absolute()
  if not path.is_dir():
    raise ValueError(f"no gates at {path}: the folder does not exist (train them with "
                     "python -m kvjax.retrieval_heads)")
  restored = checkpoint.restore_items(
      path, f"{path} is not a complete gates checkpoint (truncated or corrupt)",
      gates="array", metadata="json")
  try:
    gates = np.asarray(restored["gates"]["gates"], np.float32)
    metadata = dict(restored["metadata"])
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path} is not a complete gates checkpoint (truncated or corrupt): "
                     f"{type(e).__name__}: {e}") from e
  expected = (metadata.get("num_layers"), metadata.get("num_kv_heads"))
  if gates.ndim != 2 or gates.shape != expected:
    raise ValueError(f"{path}: gates of shape {gates.shape} disagree with the metadata's "
                     f"[L, K] = {list(expected)}: a corrupt checkpoint")
  if model is not None and metadata.get("model") != model:
    raise ValueError(f"{path} holds gates trained for {metadata.get('model')!r}, "
                     f"not {model!r}")
  return gates, metadata


def shipped() -> list[str]:
  """The model names kvjax ships gates for."""
  if not SHIPPED.is_dir():
    return []
  return sorted(p.name for p in SHIPPED.iterdir() if p.is_dir())


def shipped_gates_path(model_name: str) -> pathlib.Path:
  """The folder of the gates shipped for ``model_name`` (a registry name).

  Raises:
    ValueError: none shipped for it (the message lists those that are).
  """
  folder = SHIPPED / str(model_name)
  if pathlib.Path(str(model_name)).name != model_name or not folder.is_dir():
    raise ValueError(f"kvjax ships no retrieval-head gates for {model_name!r}; it ships "
                     f"gates for {shipped() or 'no model'} (train others with "
                     "python -m kvjax.retrieval_heads --model=...)")
  return folder
