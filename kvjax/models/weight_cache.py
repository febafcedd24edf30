"""Converted weights kept with orbax, so a later ``kvjax.load`` of the same file skips conversion.

Loading a GGUF dequantizes its blocks and reorders llama.cpp's rows; loading a
safetensors folder transposes and joins matrices; both parse the tokenizer.
``kvjax.load(..., weight_cache=True)`` saves the result once, under
``<cache dir>/weights/<key>``: the parameters (``orbax.checkpoint``), the
config and the tokenizer; the next load with the same key restores them.

The key covers what the result depends on: each source file's name, size and
modification time, the dtype, the layer layout, packing and this format's
version. A changed file is a new key; old entries stay until removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import uuid

import jax.numpy as jnp
from flax import nnx

FORMAT = 1  # bump when what is saved, or how weights are converted, changes
_DONE = "complete"  # written last: a folder without it is an interrupted save


def root(weight_cache: bool | str | os.PathLike | None) -> pathlib.Path | None:
  """The cache's folder: None (off) for None/False, the user cache dir's for True.

  Raises:
    ValueError: a file where the folder (or a folder above it) would be.
  """
  if weight_cache is None or weight_cache is False:
    return None
  from kvjax import paths
  folder = paths.cache_dir() / "weights" if weight_cache is True else pathlib.Path(weight_cache)
  blocking = next((p for p in (folder, *folder.parents) if p.exists()), None)
  if blocking is not None and not blocking.is_dir():
    where = f" (${paths.CACHE_ENV})" if weight_cache is True else ""
    raise ValueError(f"the weight cache's folder {folder}{where} cannot be made: {blocking} "
                     "is a file")
  return folder


def entry(root_dir: pathlib.Path, source: pathlib.Path, *, dtype, scan_layers: bool,
          packed: bool) -> pathlib.Path:
  """The folder of ``source``'s converted weights under these options."""
  files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
  digest = hashlib.sha256()
  for f in files:
    st = f.stat()
    digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
  digest.update(f"{jnp.dtype(dtype).name}:{scan_layers}:{packed}:{FORMAT}".encode())
  return root_dir / f"{source.name}-{digest.hexdigest()[:20]}"


def save(folder: pathlib.Path, lm) -> None:
  """Saves ``lm``'s parameters, config and tokenizer to ``folder`` (atomically)."""
  import orbax.checkpoint as ocp
  if (folder / _DONE).is_file():
    return
  folder.parent.mkdir(parents=True, exist_ok=True)
  partial = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}"
  partial.mkdir()
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save((partial / "params").absolute(), nnx.to_pure_dict(lm.params))
    (partial / "config.json").write_text(json.dumps(dataclasses.asdict(lm.config)))
    (partial / "load.json").write_text(json.dumps(dict(
        source=lm.source, scan_layers=lm.scan_layers,
        config_class=type(lm.config).__name__)))
    if lm.tokenizer is not None:
      lm.tokenizer.save(partial)
    (partial / _DONE).write_text("")
    os.replace(partial, folder)
  except OSError:
    shutil.rmtree(partial, ignore_errors=True)
    if not (folder / _DONE).is_file():
      raise


def restore(folder: pathlib.Path, dtype):
  """(config, graphdef, params, tokenizer, source) saved in ``folder``; None without a
  complete entry. ``kvjax.load`` makes them a LanguageModel."""
  if not (folder / _DONE).is_file():
    return None
  import orbax.checkpoint as ocp
  from kvjax.models.config import RopeScaling, config_class
  from kvjax.models.gemma3 import module_class
  from kvjax.models.tokenizer import Tokenizer
  values = json.loads((folder / "config.json").read_text())
  if values.get("rope_scaling") is not None:
    values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
  load = json.loads((folder / "load.json").read_text())
  # Entries written before Gemma 3 name no class: they are Llama configs.
  config = config_class(load.get("config_class", "LlamaConfig"))(**values)
  module = module_class(config)
  abstract = nnx.eval_shape(lambda: module(config, dtype=dtype, rngs=nnx.Rngs(0),
                                           scan_layers=load["scan_layers"]))
  graphdef, state = nnx.split(abstract)
  with ocp.StandardCheckpointer() as checkpointer:
    pure = checkpointer.restore((folder / "params").absolute())
  nnx.replace_by_pure_dict(state, pure)
  has_tokenizer = (folder / "specials.json").is_file()
  tokenizer = Tokenizer.from_saved(folder) if has_tokenizer else None
  return config, graphdef, state, tokenizer, load["source"]
