"""Eviction policies, selectable by name: ``kvjax.policies.get("full")``.

One file per method (its paper, parameters and our choices open the file);
the stages they share live in ``scoring`` (token scores, the observation
window's ``WindowScorer``), ``selection`` (keep masks, segments, budgets),
``delimiters`` (cut points from token text) and ``fields`` (the shared
hyper-parameters as dataclass mixins).
"""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Full
from kvjax.policies.base import Policy
from kvjax.policies.chunkkv import ChunkKV
from kvjax.policies.delimiters import delimiter_ids
from kvjax.policies.dynsplit import DynSplitKV
from kvjax.policies.h2o import H2O
from kvjax.policies.knorm import KNorm
from kvjax.policies.paged_eviction import PagedEviction
from kvjax.policies.pyramidkv import PyramidKV
from kvjax.policies.sablock import SABlock
from kvjax.policies.sentencekv import SentenceKV
from kvjax.policies.snapkv import SnapKV
from kvjax.policies.streaming_llm import StreamingLLM

_REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, SnapKV, PyramidKV, KNorm, H2O, ChunkKV, SentenceKV,
                PagedEviction, SABlock, DynSplitKV)
}


def names() -> list[str]:
  """Names of the registered policies."""
  return sorted(_REGISTRY)


def window_fields(name: str, window: int) -> dict:
  """``{"window": w}`` (H2O: ``{"recent": w}``) for a policy that has one; {} otherwise or for 0.

  How the command-line tools set one observation window across many policies.
  """
  if not window:
    return {}
  known = {f.name for f in dataclasses.fields(type(get(name)))}
  return {f: window for f in ("window", "recent") if f in known}


def get(name: str | Policy, **fields) -> Policy:
  """A policy by name, with hyper-parameters as keyword fields.

  Raises:
    ValueError: unknown name or unknown field.
  """
  if isinstance(name, Policy):
    return dataclasses.replace(name, **fields) if fields else name
  if name not in _REGISTRY:
    raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(names())}")
  cls = _REGISTRY[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(
        f"policy {name!r} has no field(s) {unknown}; its fields: {sorted(known) or 'none'}")
  return cls(**fields)


__all__ = [
    "ChunkKV",
    "DynSplitKV",
    "Full",
    "H2O",
    "KNorm",
    "PagedEviction",
    "Policy",
    "PyramidKV",
    "SABlock",
    "SentenceKV",
    "SnapKV",
    "StreamingLLM",
    "delimiter_ids",
    "get",
    "names",
    "window_fields",
]
