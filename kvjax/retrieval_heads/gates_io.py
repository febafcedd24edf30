"""Trained gates on disk: one orbax checkpoint folder per model, and the ones kvjax ships.

A folder holds two orbax items (``orbax.checkpoint.CompositeCheckpointHandler``):

  gates     {"gates": [L, K] float32}, higher = more of a retrieval head
  metadata  JSON: the model, what the gates were trained with, the losses

``kvjax/retrieval_heads/gates/<model name>/`` holds the gates trained for a
registry model (``shipped_gates_path``); ``python -m kvjax.retrieval_heads``
writes new ones. The readers live in ``kvjax.policies.gates`` (Duo reads
gates without importing the training code) and are re-exported here.

Dimension letters: L layers, K KV heads.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import numpy as np

from kvjax.cache import checkpoint
from kvjax.policies.gates import SHIPPED  # noqa: F401  (re-exported)
from kvjax.policies.gates import load_gates  # noqa: F401
from kvjax.policies.gates import shipped  # noqa: F401
from kvjax.policies.gates import shipped_gates_path  # noqa: F401

FORMAT = 1  # bump when what is saved changes


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
