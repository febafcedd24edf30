"""Learned retrieval heads (DuoAttention, arXiv 2410.10819): gates that say which KV heads
need the whole context and which do with attention sinks and recent tokens.

  gates, losses = train_gates(lm)               # [L, K] float32, 1 = retrieval head
  save_gates(folder, gates, model=..., n_sink=4, recent=64, steps=80, losses=losses)
  gates, metadata = load_gates(shipped_gates_path("smollm2-135m-instruct"))

``python -m kvjax.retrieval_heads`` trains and saves them. The names load on
first use: reading gates (``load_gates``) never imports the models or optax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it.
_NAMES = {
    "train_gates": "kvjax.retrieval_heads.train",
    "mixed_attention": "kvjax.retrieval_heads.train",
    "save_gates": "kvjax.retrieval_heads.gates_io",
    "load_gates": "kvjax.retrieval_heads.gates_io",
    "shipped_gates_path": "kvjax.retrieval_heads.gates_io",
}

__all__ = sorted(_NAMES)

if TYPE_CHECKING:
  from kvjax.retrieval_heads.gates_io import load_gates, save_gates, shipped_gates_path
  from kvjax.retrieval_heads.train import mixed_attention, train_gates


def __getattr__(name: str):
  if name not in _NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_NAMES[name]), name)
  globals()[name] = value  # later lookups skip this function
  return value
