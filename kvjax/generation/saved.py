"""Compress once, answer many: a document's compressed cache kept, saved and questioned.

  context = kvjax.compress(lm, [document], policy="snapkv", budget=256)
  kvjax.save_cache("doc.kvcache", context)
  ...
  context = kvjax.load_cache("doc.kvcache", lm)
  first, second = kvjax.answer(lm, context, ["Who ...?", "When ...?"])

``compress`` is ``generate``'s query-agnostic prefill on its own: the policy
compresses the document (the question is not in it), and the cache it leaves
is kept. ``answer`` then runs what ``generate(..., query_aware=False)`` runs
after its prefill (``api.finish_run``): the question appended uncompressed
(the ``extend`` program), then the decode loop, on a copy of that cache laid
out as generate would lay it out for that question. The document is never
prefilled again, and the greedy tokens are generate's.

Dimension letters: B documents, T padded document tokens, L layers, K KV heads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import execution
from kvjax import policies as policies_lib
from kvjax.cache import attention as attention_lib
from kvjax.cache import checkpoint
from kvjax.cache.paged import EMPTY, PagedKVCache
from kvjax.generation import api
from kvjax.generation import calls
from kvjax.generation import inputs
from kvjax.generation import plan as plan_lib
from kvjax.generation.compile import Clock
from kvjax.models.config import LlamaConfig, RopeScaling, config_class
from kvjax.models.lm import LanguageModel

# What a question and its answer take per head unless compress is told otherwise:
# generate's defaults, a question of up to pad_multiple = 64 tokens and 64 new ones.
DEFAULT_ROOM = 128


@dataclasses.dataclass(frozen=True, eq=False)
class CompressedContext:
  """Documents prefilled and compressed by a policy, ready for questions (``answer``)."""

  cache: PagedKVCache  # the cache right after prefill and compression (B sequences)
  lengths: np.ndarray  # [B] int32 document tokens: positions 0 .. n - 1; the next is n
  prompt_len: int  # T: the padded document length the policy's budgets were set for
  policy: policies_lib.Policy  # bound to the tokenizer
  budget: int | None  # entries per (layer, KV head) after prefill; None for "full"
  room: int  # entries per head the policy was sized to leave for a question and its answer
  chat_template: bool  # the documents were the head of a chat user turn
  config: LlamaConfig  # the model the cache belongs to
  source: str = ""  # where that model's weights came from (LanguageModel.source)

  @property
  def batch_size(self) -> int:
    return len(self.lengths)

  @property
  def kv_bytes(self) -> int:
    """Bytes of the page pool's keys and values."""
    return self.cache.kv_bytes


def compress(lm: LanguageModel, documents: inputs.Prompts, *,
             policy: str | policies_lib.Policy = "full", budget: int | None = None,
             room: int = DEFAULT_ROOM, chat_template: bool = False, page_size: int = 16,
             backend: str = "auto", pad_multiple: int = 64,
             attention_block: int = attention_lib.PREFILL_BLOCK) -> CompressedContext:
  """Prefills documents and compresses them under a policy, with no question in sight.

  Args:
    lm: a model from ``kvjax.load``.
    documents: one string, a list of strings, or a list of token-id lists.
    policy, budget: as in ``generate``.
    room: entries per head left for a question (padded to ``pad_multiple``)
      and its answer (``max_new_tokens``). Only policies that give each head
      whole pages (AdaKV, Duo) keep differently for another room; ``answer``
      refuses a question and answer longer than it for them. The default,
      128, is what ``generate``'s defaults take: a question of up to 64
      tokens and 64 new tokens.
    chat_template: make each document the head of a user turn of the model's
      chat template, as ``generate(..., questions=..., chat_template=True,
      query_aware=False)`` does; ``answer`` then appends the turn's end.
    page_size, backend, pad_multiple, attention_block: as in ``generate``.

  Returns:
    The CompressedContext: its cache holds what the policy kept per head, in
    a pool of just the pages that takes (``trimmed``).

  Raises:
    ValueError: a bad argument (see ``generate``), before any work is done.
  """
  if not inputs._is_int(room) or room < 1:  # pylint: disable=protected-access
    raise ValueError(f"room must be a positive int, got {room!r}")
  options = inputs.Options(max_new_tokens=room, page_size=page_size,
                           pad_multiple=pad_multiple, attention_block=attention_block,
                           prefill_chunk=0, stop_ids=(), temperature=0.0, top_k=0, seed=0,
                           ex=execution.create(backend))
  (policy, budget), = inputs.check(lm, [(policy, budget)], options)
  if chat_template:
    docs = inputs._as_list(documents, "documents")  # pylint: disable=protected-access
    # The turn is cut where the question would start: what comes before it.
    documents, _ = inputs._chat_turns(lm, docs, [""] * len(docs))  # pylint: disable=protected-access
  batch = inputs.batch(lm, documents, None, query_aware=False, chat_template=False,
                       options=options)
  clock = Clock()
  recorded = calls.record(lm, batch, options, clock) if policy.needs_every_layer else None
  plan = plan_lib.plan_run(lm.config, batch, policy, budget, options, recorded is not None)
  new_cache = lambda: calls.new_cache(lm, batch, options, plan)
  calls.compile_prefill(lm, batch, options, plan, clock, recorded, jax.eval_shape(new_cache))
  cache, _ = calls.run_prefill(lm, batch, options, plan, clock, recorded, new_cache())
  return CompressedContext(cache=trimmed(cache), lengths=np.asarray(batch.lengths, np.int32),
                           prompt_len=batch.prompt_len, policy=policy, budget=budget, room=room,
                           chat_template=chat_template, config=lm.config, source=lm.source)


def answer(lm: LanguageModel, context: CompressedContext,
           questions: str | Sequence[str] | Sequence[Sequence[int]], *,
           max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
           stop_ids: Sequence[int] | None = None, chat_template: bool | None = None,
           backend: str = "auto", pad_multiple: int = 64) -> list[api.GenerationResult]:
  """Asks each question of every document of ``context``, without prefilling them again.

  Each question is appended to a copy of the context's cache (``context`` is
  left as it is) and answered as ``generate(lm, documents, questions=...,
  query_aware=False, policy=..., budget=...)`` answers it: the same tokens.

  Args:
    lm: the model the context was compressed with.
    context: from ``compress`` or ``load_cache``.
    questions: one question, or a list: each a string or a list of token ids.
    max_new_tokens, temperature, top_k, seed, stop_ids, backend, pad_multiple:
      as in ``generate``.
    chat_template: whether the question ends a chat turn (None: as the
      context was compressed).

  Returns:
    A GenerationResult per question (B texts each); ``stats.prefill_s`` is
    the time spent appending the question.

  Raises:
    ValueError: another model than the context's, a bad argument, or (AdaKV,
      Duo) a question and answer that need more than the context's room.
  """
  check_model(lm, context.config, context.source, "the context")
  if isinstance(questions, str) or (len(questions) and inputs._is_int(questions[0])):  # pylint: disable=protected-access
    questions = [questions]
  if not len(questions):
    raise ValueError("questions is empty")
  if stop_ids is None:
    stop_ids = lm.tokenizer.stop_ids if lm.tokenizer is not None else ()
  options = inputs.Options(
      max_new_tokens=max_new_tokens, page_size=context.cache.page_size,
      pad_multiple=pad_multiple, attention_block=attention_lib.PREFILL_BLOCK, prefill_chunk=0,
      stop_ids=tuple(stop_ids), temperature=temperature, top_k=top_k, seed=seed,
      ex=execution.create(backend))
  (policy, budget), = inputs.check(lm, [(context.policy, context.budget)], options)
  chat = context.chat_template if chat_template is None else chat_template
  # Stand-ins for the documents: only their lengths matter from here on.
  documents = [[0] * int(n) for n in context.lengths]
  results = []
  for question in questions:
    if chat:  # the turn's part from where the question starts (any document gives the same)
      question = inputs._chat_turns(lm, ["."], [question])[1][0]  # pylint: disable=protected-access
    batch = inputs.batch(lm, documents, [question] * context.batch_size, query_aware=False,
                         chat_template=False, options=options)
    batch = dataclasses.replace(
        batch, tokens=np.zeros((context.batch_size, context.prompt_len), np.int32))
    plan = plan_lib.plan_run(lm.config, batch, policy, budget, options, False)
    plan_options = options
    # A policy whose heads have budgets of their own (AdaKV, Duo) kept for the
    # room it was given: its layout is the one for that room.
    if plan.layout.per_head:
      if batch.question_len + max_new_tokens > context.room:
        raise ValueError(
            f"policy {policy.name!r} kept the documents for a question and answer of "
            f"{context.room} entries per head (compress's room); this question "
            f"({batch.question_len} tokens padded) and max_new_tokens {max_new_tokens} need "
            f"{batch.question_len + max_new_tokens}: compress with a larger room")
      plan_options = dataclasses.replace(options,
                                         max_new_tokens=context.room - batch.question_len)
      plan = plan_lib.plan_run(lm.config, batch, policy, budget, plan_options, False)
    cache = relaid(context.cache, calls.new_cache(lm, batch, plan_options, plan),
                   extra_tokens=batch.question_len)
    results.append(api.finish_run(lm, batch, options, plan, Clock(), cache, None))
  return results


def trimmed(cache: PagedKVCache) -> PagedKVCache:
  """``cache`` in the smallest pool that holds it: each (layer, KV head) a capacity of the
  pages its longest sequence uses (at least one), and no free page."""
  ps = cache.page_size
  capacity = np.maximum(-(-np.asarray(cache.lengths).max(0) // ps), 1) * ps  # [L, K]
  _, l, k, _ = cache.page_table.shape
  return relaid(cache, PagedKVCache.create(
      batch_size=cache.batch_size, capacity=capacity.tolist(), num_layers=l, num_kv_heads=k,
      head_dim=cache.k_pages.shape[-1], page_size=ps, dtype=cache.k_pages.dtype,
      windows=cache.windows))


def relaid(cache: PagedKVCache, empty: PagedKVCache, *, extra_tokens: int = 0) -> PagedKVCache:
  """``cache``'s entries in ``empty``'s layout (its capacity and pool), page for page.

  A head's slots fill from 0 and its pages are its page-table row's first
  ones (the cache's invariants), so copying each head's pages in order into
  fresh pages of ``empty`` keeps every slot where it was: attention reads the
  same entries in the same order. ``cache`` is not changed.

  Args:
    cache: the filled cache, [B, L, K] heads.
    empty: an empty cache of the same B, L, K, H, page size and dtype.
    extra_tokens: entries each head but a ring's must still have room for (the question).

  Raises:
    ValueError: the layouts disagree, or ``empty`` lacks room for a head.
  """
  if (cache.page_table.shape[:3] != empty.page_table.shape[:3]
      or cache.k_pages.shape[1:] != empty.k_pages.shape[1:]
      or cache.k_pages.dtype != empty.k_pages.dtype or cache.windows != empty.windows):
    raise ValueError(f"cannot lay a cache of heads {cache.page_table.shape[:3]} and pages "
                     f"{cache.k_pages.dtype}{list(cache.k_pages.shape[1:])} out as one of "
                     f"{empty.page_table.shape[:3]}, "
                     f"{empty.k_pages.dtype}{list(empty.k_pages.shape[1:])}")
  table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)  # [B, L, K, P_max]
  room = np.asarray(empty.capacity)[None] - lengths  # [B, L, K]
  # A ring layer (a sliding window) takes new entries over its oldest ones.
  ring = np.asarray(empty.windows or (0,) * empty.num_layers)[None, :, None] > 0
  short = room < np.where(ring, 0, extra_tokens)
  if short.any():
    b, l, k = np.argwhere(short)[0]
    raise ValueError(f"head (sequence {b}, layer {l}, KV head {k}) holds {lengths[b, l, k]} "
                     f"entries: no room for {extra_tokens} more in a capacity of "
                     f"{empty.capacity[l][k]}")
  ps = cache.page_size
  pages = -(-lengths // ps)  # [B, L, K] pages each head uses
  if pages.sum() > empty.num_pages:
    raise ValueError(f"the cache's heads use {pages.sum()} pages; the new pool has "
                     f"{empty.num_pages}")
  old = table[np.arange(table.shape[-1]) < pages[..., None]]  # flat in (B, L, K, page) order
  new_table = np.full(empty.page_table.shape, EMPTY, np.int32)
  new_table[np.arange(new_table.shape[-1]) < pages[..., None]] = np.arange(len(old))
  # An empty pool's free stack hands out page 0 first: taking pages 0 .. n - 1 leaves
  # it as n pops would.
  pools = _copy_pages(tuple(getattr(cache, name) for name in _POOLS),
                      tuple(getattr(empty, name) for name in _POOLS), jnp.asarray(old, jnp.int32))
  return empty.replace(**dict(zip(_POOLS, pools)), page_table=jnp.asarray(new_table),
                       lengths=jnp.asarray(lengths, jnp.int32), num_free=empty.num_free - len(old))


_POOLS = ("k_pages", "v_pages", "positions", "scores")  # [P, S_page, ...] per-slot arrays


@functools.partial(jax.jit, donate_argnums=(1,))
def _copy_pages(pools: tuple, empty: tuple, old: jax.Array) -> tuple:
  """``empty``'s pools with their pages 0 .. M - 1 copied from ``pools``' pages ``old`` [M]."""
  new = jnp.arange(old.shape[0])
  return tuple(e.at[new].set(p[old]) for p, e in zip(pools, empty))


# ------------------------------------------------------------------ on disk


def save_cache(path: str | os.PathLike, context: CompressedContext, *,
               overwrite: bool = False) -> pathlib.Path:
  """Writes a compressed context to the orbax folder ``path`` (``kvjax.cache.checkpoint``).

  Saved: every array of the cache (k_pages and v_pages [P, S_page, H] in the
  cache's dtype, positions, scores, page table, lengths, free pages), its
  static fields (page size, capacity [L][K]), and the context: the policy's
  name and fields, the budget, the room, the documents' lengths [B] and
  padded length T, the model's name, source and config, the kvjax version.

  Args:
    overwrite: replace a cache saved at ``path`` before (never anything else).

  Returns:
    The folder, absolute.

  Raises:
    ValueError: ``path`` taken, or a policy field that JSON cannot hold.
  """
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  extra = dict(
      kvjax_version=metadata.version("kvjax"),
      model=dict(name=context.config.name, source=context.source,
                 config_class=type(context.config).__name__,
                 config=dataclasses.asdict(context.config)),
      policy=_policy_json(context.policy), budget=context.budget, room=int(context.room),
      lengths=[int(n) for n in context.lengths], prompt_len=int(context.prompt_len),
      chat_template=bool(context.chat_template), page_size=int(context.cache.page_size),
      dtype=str(context.cache.k_pages.dtype))
  return checkpoint.save(path, context.cache, extra=extra, overwrite=overwrite)


def load_cache(path: str | os.PathLike, lm: LanguageModel | None = None) -> CompressedContext:
  """The compressed context ``save_cache`` wrote to ``path``.

  Args:
    lm: when given, the model the cache must belong to (same config: name,
      shape, numerics) and dtype; checked before the arrays are read.

  Raises:
    ValueError: no such folder; a folder that is not a saved cache, or a
      cache saved without ``save_cache``'s context; a truncated or corrupt
      one; a cache of another model than ``lm``. Each names the folder.
  """
  path = pathlib.Path(path).expanduser().absolute()
  extra = checkpoint.read_metadata(path).get("extra") or {}
  missing = {"model", "policy", "lengths", "prompt_len", "room"} - set(extra)
  if missing:
    raise ValueError(f"{path} is a saved KV cache but not a compressed context from "
                     f"kvjax.save_cache (its metadata lacks {sorted(missing)})")
  try:
    model = extra["model"]
    config = _config_from_json(model.get("config_class", "LlamaConfig"), model["config"])
    policy = _policy_from_json(extra["policy"])
    lengths = np.asarray(extra["lengths"], np.int32)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path}: its context metadata cannot be read back: "
                     f"{type(e).__name__}: {e}") from e
  if lm is not None:
    check_model(lm, config, model.get("source", ""), str(path))
    if extra.get("dtype") != str(jnp.dtype(lm.dtype)):
      raise ValueError(f"{path} holds a {extra.get('dtype')} cache; the model runs in "
                       f"{jnp.dtype(lm.dtype)}: load it with dtype={extra.get('dtype')}")
  cache, _ = checkpoint.load(path)
  want = (len(lengths), config.num_layers, config.num_kv_heads)
  if cache.page_table.shape[:3] != want or cache.k_pages.shape[-1] != config.head_dim:
    raise ValueError(f"{path} is corrupt: its cache has heads {cache.page_table.shape[:3]} of "
                     f"dim {cache.k_pages.shape[-1]}; its metadata says {want} of dim "
                     f"{config.head_dim}")
  return CompressedContext(cache=cache, lengths=lengths, prompt_len=int(extra["prompt_len"]),
                           policy=policy, budget=extra.get("budget"), room=int(extra["room"]),
                           chat_template=bool(extra.get("chat_template", False)), config=config,
                           source=str(model.get("source", "")))


def check_model(lm: LanguageModel, config: LlamaConfig, source: str, where: str) -> None:
  """Raises ValueError unless ``lm`` has ``config`` (the model a cache was made with)."""
  if lm.config == config and type(lm.config) is type(config):
    return
  differ = [f"{f.name} {getattr(config, f.name, None)!r} "
            f"(model {getattr(lm.config, f.name, None)!r})"
            for f in dataclasses.fields(config) + dataclasses.fields(lm.config)
            if getattr(config, f.name, None) != getattr(lm.config, f.name, None)]
  if type(lm.config) is not type(config):
    differ.insert(0, f"a {type(config).__name__} (model {type(lm.config).__name__})")
  differ = list(dict.fromkeys(differ))
  raise ValueError(f"{where} holds a cache of model {config.name!r} ({source or 'unknown'}), "
                   f"not of this model {lm.config.name!r} ({lm.source or 'unknown'}): "
                   f"{'; '.join(differ)}")


def _policy_json(policy: policies_lib.Policy) -> dict[str, Any]:
  """{"name": ..., "fields": {...}}: the fields a user sets (a wrapped policy nested alike)."""
  fields = {}
  for f in dataclasses.fields(policy):
    value = getattr(policy, f.name)
    if isinstance(value, policies_lib.Policy):
      value = _policy_json(value)
    elif isinstance(value, tuple):
      value = list(value)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
      raise ValueError(f"policy {policy.name!r}: field {f.name}={value!r} cannot be saved "
                       "(not a JSON value)")
    fields[f.name] = value
  return dict(name=policy.name, fields=fields)


def _policy_from_json(data: dict[str, Any]) -> policies_lib.Policy:
  fields = {k: _policy_from_json(v) if isinstance(v, dict) else
            tuple(v) if isinstance(v, list) else v for k, v in data["fields"].items()}
  return policies_lib.get(data["name"], **fields)


def _config_from_json(class_name: str, data: dict[str, Any]) -> LlamaConfig:
  scaling = data.get("rope_scaling")
  return config_class(class_name)(**{**data, "rope_scaling": None if scaling is None
                                     else RopeScaling(**scaling)})
