"""What ``"auto"`` runs, per platform and op, and the measurement each choice rests on.

``"auto"`` must never run a slower implementation than the one it passes
over, so it picks only what a measurement on that platform showed faster; a
pair without one runs XLA (the references, compiled by XLA for every
platform). Each entry names the figures and where they come from; a new
measurement changes the entry and its reason together.

The CPU's ``"native"`` choices hold only where the C++ kernels build
(``kvjax.backend.native_available``); elsewhere ``"auto"`` runs XLA. Pallas
never runs under ``"auto"`` on a CPU: no compiler there, only the interpreter.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation ``"auto"`` runs for one (platform, op), and why."""

  backend: str  # "xla", "pallas" or "native"
  why: str  # the measurement (figures, machine, command or results file), or why none


NOT_MEASURED = Choice("xla", "not measured")

_PACKED_RUN = ("SmolLM2-135M Q4_1 packed, 2-core CPU; docs/results/vs_kvpress.md "
               "'Packed weights and native prompt kernels'")
_PAGED_ATTENTION_H200 = (
    "H200, bfloat16, jax 0.11.2, 2026-12: kernel alone (benchmarks/kernels/"
    "bench_paged_attention.py --dtype=bfloat16 --batch=8 --kv_heads=8 --group=4 "
    "--max_pages=2048) Pallas 0.52 TB/s, XLA 0.52 TB/s; decode step of the "
    "Llama-3.2-1B shape (configs/llama3_2_1b.py), full cache, batch 1: Pallas 11.6 ms, "
    "XLA 4.3 ms at 32K; Pallas 39.0 ms, XLA 8.2 ms at 128K")
_SCALAR_WALK = ("not timed on a device; the kernel is a sequential scalar walk, O(T) "
                "steps per sequence beside an O(T^2) prefill")

# (platform as jax.default_backend() names it, op) -> Choice. Pairs not listed: NOT_MEASURED.
AUTO_CHOICES: dict[tuple[str, str], Choice] = {
    ("cpu", "paged_attention"): Choice(
        "native", "whole decode steps 46.0-50.1 ms (XLA) -> 37.1-41.8 ms (native), SmolLM2 "
        "4K prompt, snapkv budget 1024, unrolled layers, 2-core CPU, 3 alternating rounds; "
        "docs/results/vs_kvpress.md"),
    ("cpu", "causal_attention"): Choice(
        "native", f"82 GFLOP/s against XLA's blockwise form's 45-52; {_PACKED_RUN}"),
    ("cpu", "quantized_matmul"): Choice(
        "native", "82-107 GFLOP/s reading the blocks in place; XLA's reference dequantizes "
        f"the whole matrix first, and its float32 GEMM alone runs at 81-117; {_PACKED_RUN}"),
    ("cpu", "dequantize"): Choice(
        "native", "timed as part of packed decoding (steps at budget 1024: 25-31 ms); "
        f"{_PACKED_RUN}"),
    ("gpu", "paged_attention"): Choice("xla", _PAGED_ATTENTION_H200),
    ("gpu", "segment_ids"): Choice("xla", _SCALAR_WALK),
    ("gpu", "dynamic_split"): Choice(
        "xla", "the Triton lowering refuses the kernel's arrays at lengths that are not "
        "powers of 2 (H200, jax 0.11.2: shape (1, 171) for a 2,047-token prompt); "
        + _SCALAR_WALK),
    ("tpu", "segment_ids"): Choice("xla", _SCALAR_WALK),
    ("tpu", "dynamic_split"): Choice("xla", _SCALAR_WALK),
}


def auto_choice(platform: str, op: str) -> Choice:
  """The table's choice for ``op`` on ``platform`` (XLA where nothing was measured)."""
  return AUTO_CHOICES.get((platform, op), NOT_MEASURED)
