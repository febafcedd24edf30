"""The sizes of a run ("full" on a GPU/TPU, "small" on CPU) and the model configs they name."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import jax

from kvjax.bench.accelerator import shapes

COMMAND = "python -m kvjax.bench --preset=accelerator"


@dataclasses.dataclass(frozen=True)
class Scale:
  """The sizes of a run: "full" on a GPU/TPU, "small" on CPU (a plumbing check)."""

  name: str
  model: str  # a shipped shape (shapes.SHAPES), or a config file's path (--config)
  equality_model: str
  dtype: str
  kernel_shapes: tuple[tuple[int, int, int, int, int], ...]  # (B, K, G, H, slots)
  prompt_shapes: tuple[tuple[int, int, int, int, int], ...]  # (B, T, N, K, H), causal
  contexts: tuple[int, ...]  # decode section
  budget: int
  decode_steps: int
  repeats: int
  throughput_context: int
  batches: tuple[int, ...]
  prefill_length: int
  prefill_chunk: int
  equality_prompt: int  # tokens; not a power of two on purpose
  equality_budget: int
  equality_tokens: int
  window: int  # observation window of the equality run's policies (0: their default)
  equality_policies: tuple[str, ...] = ()  # () = every policy of kvjax.policies.names()
  page_size: int = 16


FULL = Scale("full", "llama3_2_1b", "smollm2_135m", "bfloat16",
             kernel_shapes=((8, 8, 4, 64, 32768), (1, 8, 4, 64, 32768)),
             prompt_shapes=((1, 32768, 32, 8, 64),),  # Llama-3.2-1B's heads
             contexts=(32768, 131072), budget=1024, decode_steps=16, repeats=2,
             throughput_context=32768, batches=(16, 64, 256), prefill_length=32768,
             prefill_chunk=4096, equality_prompt=1531, equality_budget=256,
             equality_tokens=16, window=0)
# Each program compiles in seconds on a CPU (Pallas' interpreter included): the
# small scale keeps their number down: one kernel shape, one context, and an
# equality run of the full cache and one compressing policy (window scores,
# compaction).
SMALL = Scale("small", "tiny", "tiny", "bfloat16", kernel_shapes=((2, 2, 2, 64, 1024),),
              prompt_shapes=((1, 256, 4, 2, 64),),
              contexts=(1024,), budget=128, decode_steps=3, repeats=1,
              throughput_context=1024, batches=(1, 2), prefill_length=256,
              prefill_chunk=128, equality_prompt=150, equality_budget=48,
              equality_tokens=4, window=16, equality_policies=("full", "snapkv"))


def scale_for(name: str) -> Scale:
  """"auto": small on CPU, full on a GPU/TPU."""
  if name == "auto":
    name = "small" if jax.default_backend() == "cpu" else "full"
  return {"full": FULL, "small": SMALL}[name]


def command(scale: Scale) -> str:
  """The command line that runs at ``scale`` (with the config file it was given)."""
  config = "" if scale.model in shapes.SHAPES else f" --config={scale.model}"
  return f"{COMMAND} --scale={scale.name}{config}"


def model_config(name: str):
  """The config a scale names: a shipped shape (``shapes.SHAPES``), or a config file's
  ``get_config()`` where ``name`` is a path (the preset's ``--config``).

  Raises:
    FileNotFoundError: ``name`` is neither a shipped shape nor a file.
  """
  if name in shapes.SHAPES:
    return shapes.SHAPES[name]
  path = pathlib.Path(name)
  if not path.is_file():
    raise FileNotFoundError(f"{name!r} is neither a shape the preset ships "
                            f"({', '.join(shapes.SHAPES)}) nor a config file")
  spec = importlib.util.spec_from_file_location(f"_kvjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()
