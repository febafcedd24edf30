"""Eviction policies, selectable by name: ``kvjax.policies.get("full")``.

One file per method (its paper, parameters and our choices open the file,
its formula is its ``score``). A policy is a layout (``layout.Layout``: slots
per layer and KV head), a scorer (``score``), a selector (``keep``) and a
decode rule (``decode``: nothing, evict a token, evict a page); see
``base``. The stages they share live in ``scoring`` (token scores, the
observation window's ``WindowScorer``), ``selection`` (keep masks, segments,
budgets), ``delimiters`` (cut points from token text), ``fields`` (the shared
hyper-parameters as dataclass mixins) and ``gates`` (Duo's trained gates on
disk).
"""

from __future__ import annotations

import dataclasses

from kvjax.policies.adakv import AdaKV
from kvjax.policies.base import Full
from kvjax.policies.base import Policy
from kvjax.policies.chunkkv import ChunkKV
from kvjax.policies.delimiters import delimiter_ids
from kvjax.policies.duo import Duo
from kvjax.policies.dynsplit import DynSplitKV
from kvjax.policies.h2o import H2O
from kvjax.policies.knorm import KNorm
from kvjax.policies.layout import Layout
from kvjax.policies.paged_eviction import PagedEviction
from kvjax.policies.pyramidkv import PyramidKV
from kvjax.policies.sablock import SABlock
from kvjax.policies.sentencekv import SentenceKV
from kvjax.policies.snapkv import SnapKV
from kvjax.policies.streaming_llm import StreamingLLM

_REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, SnapKV, PyramidKV, KNorm, H2O, ChunkKV, SentenceKV,
                PagedEviction, SABlock, DynSplitKV, AdaKV, Duo)
}


_BUILT_IN = frozenset(_REGISTRY)


def register(cls: type[Policy]) -> type[Policy]:
  """Makes a policy class selectable by its ``name`` (usable as a class decorator).

  Registering a name again replaces the earlier class (a notebook cell run
  twice); the built-in names cannot be taken.

  Raises:
    ValueError: not a Policy dataclass, no ``name``, or a built-in name.
  """
  if not (isinstance(cls, type) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
    raise ValueError(f"register takes a Policy dataclass, got {cls!r}")
  name = getattr(cls, "name", "")
  if not isinstance(name, str) or not name:
    raise ValueError(f"{cls.__name__} needs its own `name: ClassVar[str] = ...`")
  if name in _BUILT_IN:
    raise ValueError(f"{name!r} is a built-in policy; give {cls.__name__} another name")
  _REGISTRY[name] = cls
  return cls


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

  A wrapped policy's field (AdaKV's ``inner``) may be given by name.

  Raises:
    ValueError: unknown name or unknown field.
  """
  if isinstance(fields.get("inner"), str):
    fields["inner"] = get(fields["inner"])
  if isinstance(name, Policy):
    return dataclasses.replace(name, **fields) if fields else name
  if name not in _REGISTRY and ":" in name:
    base, *parts = name.split(":")
    given = ", ".join(f"{k}={v!r}" for k, _, v in (p.partition("=") for p in parts))
    raise ValueError(f"{name!r} is the command lines' spelling of a policy with fields; in "
                     f"Python give the fields as keywords: kvjax.policies.get({base!r}, {given})")
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
    "AdaKV",
    "ChunkKV",
    "Duo",
    "DynSplitKV",
    "Full",
    "H2O",
    "KNorm",
    "Layout",
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
    "register",
    "window_fields",
]
