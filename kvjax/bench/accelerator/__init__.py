r"""One command for a GPU or TPU: kvjax's speed against the chip's physical floor.

  python -m kvjax.bench --preset=accelerator            # results/accelerator/
  python -m kvjax.bench --preset=accelerator --sections=kernel,decode --out=/tmp/acc
  python -m kvjax.bench --preset=accelerator --config=configs/smollm2_135m.py

On the random Llama-3.2-1B shape (``shapes.LLAMA3_2_1B``, shipped with the
package and equal to configs/llama3_2_1b.py; ``--config`` names another
config file; bfloat16 weights from ``kvjax.models.lm.init_random``: nothing
is downloaded), five sections:
  kernel      per op, every registered implementation that runs here, then
              what "auto" picks: paged decode attention bytes/s (B=8 K=8 G=4
              H=64, 32K slots; and B=1; dense ``jax.nn.dot_product_attention``
              on the same keys and values as a yardstick) and a prompt's causal
              attention TFLOP/s (32K tokens, Llama-3.2-1B's heads); the faster
              implementation per op is written as a measured choice (below)
  decode      ms per decode step, batch 1, full cache vs snapkv at budget 1024,
              at 32K and 128K tokens, backends xla, pallas and auto (caches
              filled with synthetic keys and values, ``runner.synthetic_cache``)
  throughput  tokens/s at 32K, budget 1024, batch 16, 64, 256 (the first batch
              that runs out of memory is a row, and ends the sweep)
  prefill     a 32K random prompt: one shot (full, snapkv) and chunks of 4096
  equality    greedy tokens with backend "pallas" equal to "xla", per policy
              (every policy of ``kvjax.policies.names()``; random SmolLM2-shaped
              float32 model, random token ids)
Each timing follows a warm-up call and ends with ``jax.block_until_ready``.
Each row goes to --out/results.jsonl as soon as it is measured (a run cut
short keeps what it measured) with a progress line; a failure (out of memory,
a lowering error) is a row with its error. --out/summary.md holds the tables.

The kernel section writes, per op, the implementation with the smallest
geometric mean of its times over the op's shapes (among those "auto" may run:
not Pallas' interpreter) with every timing, the shapes, jax's version and the
date to --out/auto_choices.json, a measured-choices file. It changes no later
call by itself: "auto" reads it only where it is named, by
``$KVJAX_AUTO_CHOICES`` or a ``choices=`` argument (``kvjax.backend_choices``).
The run prints how to name it, and the entries to paste into
``kvjax.backend_choices.AUTO_CHOICES`` to commit the measurement. Its own
"auto" rows run what "auto" runs for any caller: the committed table, unless
the run itself was started with ``KVJAX_AUTO_CHOICES`` set.

The floor of a row is max(bytes moved / HBM bandwidth, FLOPs / bf16 peak),
with the chip's figures from ``SPECS`` (by ``jax.devices()[0].device_kind``;
"n/a" for a chip not in it). Each row's ``of_floor`` is floor time / measured
time (1.0 = at the floor).

On CPU (or with --scale=small) the same sections run at toy sizes (a 2-layer
model, 1K slots, batch 1-2, a few steps, Pallas in interpret mode): a check
of the plumbing, not of speed. Nothing refuses a CPU: every section runs.

The package: ``specs`` (chips' peak figures, a row's floor), ``shapes`` (the
shipped model shapes), ``scales`` (a run's sizes, its model configs),
``recorder`` (rows, results.jsonl, progress lines), ``kernels`` (the kernel
section), ``choices`` ("auto"'s measured choices: written, printed),
``model_sections`` (decode, throughput, prefill), ``equality``, ``summary``
(summary.md); ``run`` here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp

from kvjax.bench.accelerator.choices import table_lines
from kvjax.bench.accelerator.equality import equality_section
from kvjax.bench.accelerator.kernels import KernelCase
from kvjax.bench.accelerator.kernels import implementations
from kvjax.bench.accelerator.kernels import kernel_section
from kvjax.bench.accelerator.kernels import measure_op
from kvjax.bench.accelerator.kernels import paged_case
from kvjax.bench.accelerator.kernels import prompt_case
from kvjax.bench.accelerator.kernels import time_call
from kvjax.bench.accelerator.model_sections import decode_section
from kvjax.bench.accelerator.model_sections import param_stats
from kvjax.bench.accelerator.model_sections import prefill_section
from kvjax.bench.accelerator.model_sections import throughput_section
from kvjax.bench.accelerator.recorder import Recorder
from kvjax.bench.accelerator.recorder import describe
from kvjax.bench.accelerator.recorder import failure
from kvjax.bench.accelerator.recorder import fmt
from kvjax.bench.accelerator.scales import COMMAND
from kvjax.bench.accelerator.scales import FULL
from kvjax.bench.accelerator.scales import SMALL
from kvjax.bench.accelerator.scales import Scale
from kvjax.bench.accelerator.scales import model_config
from kvjax.bench.accelerator.scales import scale_for
from kvjax.bench.accelerator.specs import SPECS
from kvjax.bench.accelerator.specs import DeviceSpec
from kvjax.bench.accelerator.specs import device_spec
from kvjax.bench.accelerator.specs import floor_fields
from kvjax.bench.accelerator.summary import SECTIONS
from kvjax.bench.accelerator.summary import TITLES
from kvjax.bench.accelerator.summary import header
from kvjax.bench.accelerator.summary import summary_markdown

__all__ = [
    "COMMAND", "FULL", "SECTIONS", "SMALL", "SPECS", "TITLES", "DeviceSpec", "KernelCase",
    "Recorder", "Scale", "decode_section", "describe", "device_spec", "equality_section",
    "failure", "floor_fields", "fmt", "implementations", "kernel_section", "measure_op",
    "model_config", "paged_case", "param_stats", "prefill_section", "prompt_case", "run",
    "scale_for", "summary_markdown", "table_lines", "throughput_section", "time_call",
]


def _model_maker(scan_layers: bool):
  """model(name, dtype): a random model, built on first use, one at a time (device memory)."""
  from kvjax.models import lm as lm_lib
  models = {}

  def model(name, dtype):
    if name not in models:
      models.clear()
      models[name] = lm_lib.init_random(model_config(name), dtype=jnp.dtype(dtype),
                                        scan_layers=scan_layers)
    return models[name]

  return model


def run(out: str | pathlib.Path = "results/accelerator", *, scale: str = "auto",
        sections=SECTIONS, scan_layers: bool | None = None,
        config: str | pathlib.Path | None = None) -> list[dict]:
  """Runs the chosen sections; writes results.jsonl, summary.md and (kernel section)
  auto_choices.json in ``out``; returns rows.

  ``scan_layers``: the models' layer layout (None: the device's default,
  ``kvjax.models.llama.default_scan_layers``). ``config``: a config file
  (``get_config()``, as in configs/) whose shape replaces the scale's model
  in the decode, throughput and prefill sections (None: the shipped shape).
  """
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    raise ValueError(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
  from kvjax.models import llama
  scan_layers = llama.default_scan_layers(scan_layers)
  sc = scale_for(scale)
  if config is not None:
    sc = dataclasses.replace(sc, model=str(config))
    model_config(sc.model)  # a missing or broken file fails before any section runs
  out = pathlib.Path(out)
  kind = jax.devices()[0].device_kind
  spec = device_spec(kind)
  rec = Recorder(out, {"device_kind": kind, "platform": jax.default_backend(),
                       "scale": sc.name, "scan_layers": scan_layers})
  print(f"kvjax accelerator preset ({sc.name} scale) on {kind}: sections "
        f"{', '.join(sections)}; rows in {rec.path}", flush=True)
  model = _model_maker(scan_layers)
  steps = {
      "kernel": lambda: kernel_section(rec, sc, spec, out / "auto_choices.json"),
      "decode": lambda: decode_section(rec, sc, spec, model(sc.model, sc.dtype)),
      "throughput": lambda: throughput_section(rec, sc, spec, model(sc.model, sc.dtype)),
      "prefill": lambda: prefill_section(rec, sc, spec, model(sc.model, sc.dtype)),
      "equality": lambda: equality_section(rec, sc, model(sc.equality_model, "float32")),
  }
  try:
    for section in SECTIONS:
      if section in sections:
        try:
          steps[section]()
        except Exception as e:  # pylint: disable=broad-except
          rec.add(section, "(section)", "—", **failure(e))
  finally:
    rec.close()
  text = summary_markdown(rec.rows, header(kind, spec, sc, scan_layers,
                                           time.perf_counter() - rec.start), sections,
                          rec.notes)
  (out / "summary.md").write_text(text)
  print(text, flush=True)
  return rec.rows
