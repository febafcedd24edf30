"""Reading trained retrieval-head gates: what Duo needs, without the training code.

A gates folder holds two orbax items (``orbax.checkpoint.CompositeCheckpointHandler``):

  gates     {"gates": [L, K] float32}, higher = more of a retrieval head
  metadata  JSON: the model, what the gates were trained with, the losses

``kvjax/retrieval_heads/gates/<model name>/`` holds the gates shipped for a
registry model (``shipped_gates_path``); ``kvjax.retrieval_heads`` trains and
writes new ones (``gates_io.save_gates``) and re-exports these readers.

Dimension letters: L layers, K KV heads.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from kvjax.cache import checkpoint

# Package data beside the training code that wrote it (a folder, not a module).
SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "retrieval_heads" / "gates"


def load_gates(path: str | os.PathLike, *, model: str | None = None
               ) -> tuple[np.ndarray, dict[str, Any]]:
  """The gates [L, K] float32 and metadata dict saved by ``save_gates`` in ``path``.

  Args:
    model: when given, the name the gates must have been trained for.

  Raises:
    ValueError: no such folder, a folder that is not a complete gates
      checkpoint (truncated, corrupt, another kind), gates that are not finite
      values in [0, 1], or gates of another model.
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
  if not np.all((gates >= 0) & (gates <= 1)):  # NaN fails both
    raise ValueError(f"{path}: gates must be finite and in [0, 1], as save_gates writes them; "
                     f"got values in [{np.nanmin(gates)}, {np.nanmax(gates)}]"
                     f"{' and NaN' if np.isnan(gates).any() else ''}: a corrupt checkpoint")
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
