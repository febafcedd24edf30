r"""One command for a GPU or TPU: kvjax's speed against the chip's physical floor.

  python -m kvjax.bench --preset=accelerator            # results/accelerator/
  python -m kvjax.bench --preset=accelerator --sections=kernel,decode --out=/tmp/acc

On the random Llama-3.2-1B shape (configs/llama3_2_1b.py, bfloat16 weights
from ``kvjax.models.lm.init_random``: nothing is downloaded), five sections:
  kernel      per op, every registered implementation that runs here, then
              what "auto" picks: paged decode attention bytes/s (B=8 K=8 G=4
              H=64, 32K slots; and B=1; dense ``jax.nn.dot_product_attention``
              on the same keys and values as a yardstick) and a prompt's causal
              attention TFLOP/s (32K tokens, Llama-3.2-1B's heads); the faster
              implementation per op becomes "auto"'s choice (below)
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
date to --out/auto_choices.json. At full scale on a GPU or TPU it also installs
them as this device kind's measured choices
(``kvjax.backend_choices.measured_path``), which "auto" then reads before the
committed table, later sections included; and it prints the entries to paste
into ``kvjax.backend_choices.AUTO_CHOICES`` to commit the measurement.

The floor of a row is max(bytes moved / HBM bandwidth, FLOPs / bf16 peak),
with the chip's figures from ``SPECS`` (by ``jax.devices()[0].device_kind``;
"n/a" for a chip not in it). Each row's ``of_floor`` is floor time / measured
time (1.0 = at the floor).

On CPU (or with --scale=small) the same sections run at toy sizes (a 2-layer
model, 1K slots, batch 1-2, a few steps, Pallas in interpret mode): a check
of the plumbing, not of speed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import statistics
import sys
import textwrap
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend_choices

SECTIONS = ("kernel", "decode", "throughput", "prefill", "equality")
TITLES = {
    "kernel": "Paged decode attention (one query token per sequence)",
    "decode": "Decode step, batch 1 (synthetic cache)",
    "throughput": "Decode throughput by batch (synthetic cache)",
    "prefill": "Prefill of a random prompt",
    "equality": "Greedy tokens, backend pallas vs xla",
}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """A chip's published peak figures."""

  name: str
  hbm_bytes_per_s: float  # memory bandwidth
  bf16_flops_per_s: float  # dense bfloat16 matrix products
  source: str


# Vendor spec sheets; dense bf16 (NVIDIA's sheets give bf16 "with sparsity":
# half of it is the dense peak).
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h200"
_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h100"
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/a100"
_GOOGLE_TPU = "Google Cloud TPU system architecture, cloud.google.com/tpu/docs/{}"
# (pattern searched in the lower-cased device_kind, spec); the first match wins.
SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    (r"h200 nvl", DeviceSpec("NVIDIA H200 NVL", 4.8e12, 835e12, _NVIDIA_H200)),
    (r"h200", DeviceSpec("NVIDIA H200 SXM", 4.8e12, 989e12, _NVIDIA_H200)),
    (r"h100 (80gb hbm3|sxm)", DeviceSpec("NVIDIA H100 SXM", 3.35e12, 989e12, _NVIDIA_H100)),
    (r"a100.*80gb", DeviceSpec("NVIDIA A100 80GB", 2.0e12, 312e12, _NVIDIA_A100)),
    (r"tpu v5 ?(lite|e)", DeviceSpec("TPU v5e", 0.82e12, 197e12, _GOOGLE_TPU.format("v5e"))),
    (r"tpu v5p?$", DeviceSpec("TPU v5p", 2.76e12, 459e12, _GOOGLE_TPU.format("v5p"))),
    (r"tpu v6 ?(lite|e)", DeviceSpec("TPU v6e", 1.64e12, 918e12, _GOOGLE_TPU.format("v6e"))),
)


def device_spec(kind: str) -> DeviceSpec | None:
  """The spec of a ``device_kind`` (e.g. "NVIDIA H200"), None for a chip not in ``SPECS``."""
  kind = kind.lower().strip()
  return next((spec for pattern, spec in SPECS if re.search(pattern, kind)), None)


@dataclasses.dataclass(frozen=True)
class Scale:
  """The sizes of a run: "full" on a GPU/TPU, "small" on CPU (a plumbing check)."""

  name: str
  model: str  # a configs/ file's stem, or "tiny"
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


def model_config(name: str):
  """configs/<name>.py's config (the repository's or the working folder's), or the toy one."""
  from kvjax.models.config import LlamaConfig
  if name == "tiny":
    return LlamaConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=256,
                       max_position_embeddings=4096, name="tiny")
  for folder in (pathlib.Path(__file__).resolve().parents[2] / "configs",
                 pathlib.Path.cwd() / "configs"):
    path = folder / f"{name}.py"
    if path.exists():
      spec = importlib.util.spec_from_file_location(f"_kvjax_config_{name}", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      return module.get_config()
  raise FileNotFoundError(f"configs/{name}.py not found: run from the repository's root")


# ------------------------------------------------------------------ rows


def failure(e: BaseException) -> dict:
  """A failed measurement's fields: status "oom" or "error", and the message."""
  text = f"{type(e).__name__}: {e}"
  oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
  return {"status": "oom" if oom else "error", "error": " ".join(text.split())[:600]}


class Recorder:
  """Writes each row to results.jsonl as it comes and prints a progress line."""

  def __init__(self, out: pathlib.Path, context: dict):
    out.mkdir(parents=True, exist_ok=True)
    self.path = out / "results.jsonl"
    self.file = self.path.open("w")
    self.context = context
    self.rows: list[dict] = []
    self.notes: list[str] = []  # markdown lines for the end of summary.md
    self.start = time.perf_counter()

  def add(self, section: str, label: str, impl: str, **fields) -> dict:
    row = {"section": section, "label": label, "impl": impl, "status": "ok", "error": None,
           **fields, **self.context,
           "elapsed_s": round(time.perf_counter() - self.start, 2)}
    self.rows.append(row)
    self.file.write(json.dumps(row) + "\n")
    self.file.flush()
    print(f"[{row['elapsed_s']:7.1f}s] {section:<10} {label} | {impl} | {describe(row)}",
          flush=True)
    return row

  def close(self) -> None:
    self.file.close()


def fmt(x) -> str:
  if x is None:
    return "n/a"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def describe(row: dict) -> str:
  """A row's result in words: value and floor, or its failure."""
  if row["status"] != "ok":
    return f"{row['status'].upper()}: {row['error']}"
  if row["section"] == "equality":
    return ("equal" if row["equal"] else f"DIFFER from token {row['first_diff']}") + \
        f" ({row['tokens']} tokens)"
  return (f"{fmt(row['value'])} {row['unit']} (floor {fmt(row.get('floor'))}, "
          f"{fmt(row.get('of_floor'))} of it)")


def floor_fields(spec: DeviceSpec | None, seconds: float | None, nbytes: float, flops: float,
                 to_value: Callable[[float], float]) -> dict:
  """bytes, flops, floor_s (max of the bandwidth and compute bounds), the floor in the
  row's unit (``to_value(seconds)``) and of_floor = floor_s / seconds."""
  row = {"bytes": int(nbytes), "flops": int(flops), "floor_s": None, "floor": None,
         "floor_bound": None, "of_floor": None}
  if spec is not None:
    by_bytes, by_flops = nbytes / spec.hbm_bytes_per_s, flops / spec.bf16_flops_per_s
    floor_s = max(by_bytes, by_flops)
    row.update(floor_s=floor_s, floor=to_value(floor_s),
               floor_bound="bandwidth" if by_bytes >= by_flops else "compute")
    if seconds:
      row["of_floor"] = floor_s / seconds
  return row


def time_call(fn, args: tuple, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after a warm-up call (which compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def param_stats(lm) -> tuple[int, int]:
  """(bytes, count) of the model's weights: a decode step reads every one once."""
  leaves = jax.tree.leaves(lm.params)
  return sum(x.nbytes for x in leaves), sum(x.size for x in leaves)


def _backend_label(name: str, op: str = "paged_attention") -> str:
  from kvjax import backend
  return f"auto ({backend.resolve('auto', op)})" if name == "auto" else name


# ------------------------------------------------------------------ sections


COMMAND = "python -m kvjax.bench --preset=accelerator"


@dataclasses.dataclass(frozen=True)
class KernelCase:
  """One shape of an op: its inputs and what a call moves and computes."""

  label: str
  args: tuple
  nbytes: float
  flops: float
  unit: str
  to_value: Callable[[float], float]  # seconds -> the row's value


def paged_case(shape: tuple[int, ...], dtype, page_size: int) -> KernelCase:
  """Paged decode attention, every head holding all its slots: (B, K, G, H, S)."""
  b, kh, g, h, s = shape
  p_max = s // page_size
  num_pages = b * kh * p_max
  kq, kk, kv, kp = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, kh * g, h), dtype)
  k_pages = jax.random.normal(kk, (num_pages, page_size, h), dtype)
  v_pages = jax.random.normal(kv, (num_pages, page_size, h), dtype)
  table = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(b, kh, p_max)
  lengths = jnp.full((b, kh), s, jnp.int32)
  nbytes = 2 * b * kh * s * h * dtype.itemsize + 2 * q.nbytes  # keys, values; q, out
  return KernelCase(f"B={b} K={kh} G={g} H={h}, {s:,} slots, {dtype.name}",
                    (q, k_pages, v_pages, table, lengths), nbytes,
                    4 * b * kh * g * s * h,  # q.k and p.v
                    "GB/s", lambda t: nbytes / t / 1e9)


def prompt_case(shape: tuple[int, ...], dtype, page_size: int = 0) -> KernelCase:
  """A prompt's causal attention: (B, T, N, K, H)."""
  del page_size
  b, t, n, kh, h = shape
  kq, kk, kv = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(kq, (b, t, n, h), dtype)
  k = jax.random.normal(kk, (b, t, kh, h), dtype)
  v = jax.random.normal(kv, (b, t, kh, h), dtype)
  flops = 4 * b * n * h * t * (t + 1) // 2  # the causal half of q.k and p.v
  return KernelCase(f"B={b} T={t:,} N={n} K={kh} H={h}, causal prompt, {dtype.name}",
                    (q, k, v), (2 * n + 2 * kh) * b * t * h * dtype.itemsize,  # q, out; k, v
                    flops, "TFLOP/s", lambda s: flops / s / 1e12)


def implementations(op: str, dtype) -> list[str]:
  """The registered implementations of ``op`` timed here: all but the native CPU
  kernels where they do not run (off a CPU, or not built), or run the reference
  (any dtype but float32)."""
  from kvjax import backend
  names = []
  for name in backend.implementations(op):
    if name == "native" and not (jax.default_backend() == "cpu" and dtype == jnp.float32
                                 and backend.native_available()):
      continue
    names.append(name)
  return names


def _time_row(rec: Recorder, scale: Scale, spec, case: KernelCase, impl: str, fn,
              args: tuple) -> float | None:
  """Times ``fn(*args)``, adds the row; the seconds, None when it failed."""
  try:
    seconds = time_call(fn, args, max(3, 5 * scale.repeats))
  except Exception as e:  # pylint: disable=broad-except
    rec.add("kernel", case.label, impl, **failure(e))
    return None
  rec.add("kernel", case.label, impl, value=case.to_value(seconds), unit=case.unit,
          seconds=seconds,
          **floor_fields(spec, seconds, case.nbytes, case.flops, case.to_value))
  return seconds


def _dense_sdpa_row(rec: Recorder, scale: Scale, spec, case: KernelCase) -> None:
  """Paged attention's yardstick: the same keys and values contiguous, ``[B, S, K, H]``."""
  q, k_pages, v_pages, table, _ = case.args
  b, kh, p_max = table.shape
  s, h = p_max * k_pages.shape[1], k_pages.shape[2]
  try:
    dense = lambda pages: pages[table].reshape(b, kh, s, h).transpose(0, 2, 1, 3)
    args = (q, dense(k_pages), dense(v_pages))
  except Exception as e:  # pylint: disable=broad-except
    rec.add("kernel", case.label, "dense sdpa", **failure(e))
    return
  sdpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v)[:, 0])
  _time_row(rec, scale, spec, case, "dense sdpa", sdpa, args)


def measure_op(rec: Recorder, scale: Scale, spec, op: str, shapes, make_case,
               yardstick=None) -> dict | None:
  """Times every implementation of ``op`` at each shape; "auto"'s measured entry
  (``backend_choices.measured_entry``), None when no eligible one ran at every shape."""
  from kvjax import backend
  dtype = jnp.dtype(scale.dtype)
  impls = backend.implementations(op)
  names = implementations(op, dtype)
  timings = []
  for shape in shapes:
    case = make_case(shape, dtype, scale.page_size)
    seconds = {name: _time_row(rec, scale, spec, case, name, jax.jit(impls[name]), case.args)
               for name in names}
    if yardstick is not None:
      yardstick(rec, scale, spec, case)
    timings.append({"shape": case.label, "seconds": seconds})
    del case
  return backend_choices.measured_entry(timings, platform=jax.default_backend(),
                                        command=f"{COMMAND} --scale={scale.name}")


def kernel_section(rec: Recorder, scale: Scale, spec: DeviceSpec | None,
                   choices: pathlib.Path | None = None, install: bool = False) -> dict:
  """Per op, every implementation's speed, then "auto"'s choice and what "auto" runs.

  The choices go to ``choices`` (when given) and, with ``install``, to this
  device kind's measured-choices file, before "auto" is timed: its rows (and
  later sections') show the new choice. Returns op -> measured entry.
  """
  from kvjax import backend
  kind, platform = jax.devices()[0].device_kind, jax.default_backend()
  ops = (("paged_attention", scale.kernel_shapes, paged_case, _dense_sdpa_row),
         ("causal_attention", scale.prompt_shapes, prompt_case, None))
  entries = {}
  for op, shapes, make_case, yardstick in ops:
    entry = measure_op(rec, scale, spec, op, shapes, make_case, yardstick)
    if entry is not None:
      entries[op] = entry
      _save_choices(rec, kind, platform, entries, choices, install)
    for shape in shapes:
      case = make_case(shape, jnp.dtype(scale.dtype), scale.page_size)
      _time_row(rec, scale, spec, case, _backend_label("auto", op),
                jax.jit(backend.get(op, "auto")), case.args)
  _report_choices(rec, kind, platform, entries, choices, install)
  return entries


def _save_choices(rec, kind, platform, entries, choices, install) -> None:
  """Writes the choices measured so far to ``choices`` and, with ``install``, for "auto"."""
  try:
    if choices is not None:
      backend_choices.write_measured(choices, kind, platform, entries, merge=False)
    if install:
      backend_choices.write_measured(backend_choices.measured_path(kind), kind, platform,
                                     entries)
      backend_choices.forget_measured()
  except OSError as e:
    rec.notes.append(f"Writing the auto choices failed: {type(e).__name__}: {e}")
    print(f"kvjax: writing the auto choices failed: {e}", file=sys.stderr, flush=True)


def table_lines(kind: str, platform: str, entries: dict[str, dict]) -> list[str]:
  """``AUTO_CHOICES`` entries (Python source) for the measured ops."""
  lines = []
  for op, entry in entries.items():
    why = backend_choices.why_measured(kind, entry)
    pieces = textwrap.wrap(why, 76, drop_whitespace=False, break_long_words=False)
    lines += [f"    ({platform!r}, {op!r}): Choice(", f"        {entry['backend']!r},"]
    lines += [f"        {piece!r}" for piece in pieces[:-1]]
    lines.append(f"        {pieces[-1]!r}),")
  return lines


def _report_choices(rec, kind, platform, entries, choices, install) -> None:
  """Prints (and notes for summary.md) where the choices went and the lines to commit."""
  if not entries:
    rec.notes.append("No auto choices: no implementation ran at every shape of an op.")
    return
  where = [f"written to {choices}"] if choices is not None else []
  if install:
    where.append(f"installed for {kind} in {backend_choices.measured_path(kind)} "
                 "(\"auto\" reads it on this device kind)")
  else:
    # A CPU's committed choices rest on float32 native kernels, which this
    # bfloat16 run does not time; a small scale's shapes are toys.
    where.append("not installed for \"auto\" (only a full-scale run on a GPU or TPU is)")
  picks = ", ".join(f"{op}: {e['backend']}" for op, e in entries.items())
  lines = [f"Auto choices measured on {kind} ({picks}): " + "; ".join(where) + ".",
           "To commit them, put these entries in `AUTO_CHOICES` "
           "(kvjax/backend_choices.py):", "", "```python",
           *table_lines(kind, platform, entries), "```"]
  rec.notes += lines
  print("\n".join(lines), flush=True)


def _decode_row(rec, section, label, impl, lm, cfg, spec, to_value, unit) -> dict:
  """Decodes ``cfg`` on a synthetic cache; a row with ms/step or tokens/s and the floor."""
  from kvjax import policies
  from kvjax.bench import runner
  try:
    policy = policies.get(cfg.policy)
    budgets = runner.cache_budgets(lm, cfg, policy)
    m = runner.synthetic_decode(lm, cfg, policy)
  except Exception as e:  # pylint: disable=broad-except
    return rec.add(section, label, impl, **failure(e))
  c = lm.config
  w_bytes, w_count = param_stats(lm)
  entries = cfg.batch_size * c.num_kv_heads * sum(budgets)  # kept entries read per step
  nbytes = w_bytes + 2 * entries * c.head_dim * jnp.dtype(lm.dtype).itemsize
  flops = 2 * w_count * cfg.batch_size + 4 * entries * c.group_size * c.head_dim
  seconds = m["decode_s"] / m["steps"]
  return rec.add(section, label, impl, value=to_value(seconds), unit=unit, seconds=seconds,
                 batch_size=cfg.batch_size, context_length=cfg.context_length,
                 policy=cfg.policy, budget=cfg.budget, backend=cfg.backend,
                 kv_bytes=m["kv_bytes"], compile_s=m["compile_s"],
                 **floor_fields(spec, seconds, nbytes, flops, to_value))


def _bench_config(scale: Scale, lm_name: str, **fields):
  from kvjax.bench import runner
  return runner.BenchConfig(model=lm_name, decode_steps=scale.decode_steps + 1,
                            repeats=scale.repeats, fill="synthetic",
                            page_size=scale.page_size, **fields)


def decode_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """ms per decode step, batch 1: full cache vs the budget, per context and backend."""
  for n in scale.contexts:
    for policy, budget in (("full", None), ("snapkv", scale.budget)):
      label = f"{n:,} tokens, " + ("full cache" if budget is None else f"{policy} @ {budget}")
      for name in ("xla", "pallas", "auto"):
        cfg = _bench_config(scale, lm.config.name, policy=policy, budget=budget,
                            context_length=n, batch_size=1, backend=name)
        _decode_row(rec, "decode", label, _backend_label(name), lm, cfg, spec,
                    lambda t: 1e3 * t, "ms/step")


def throughput_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """Tokens/s at one context and budget by batch, until the first out-of-memory."""
  n = scale.throughput_context
  for batch in scale.batches:
    cfg = _bench_config(scale, lm.config.name, policy="snapkv", budget=scale.budget,
                        context_length=n, batch_size=batch, backend="auto")
    row = _decode_row(rec, "throughput", f"{n:,} tokens, snapkv @ {scale.budget}, "
                      f"batch {batch}", _backend_label("auto"), lm, cfg, spec,
                      lambda t, b=batch: b / t, "tokens/s")
    if row["status"] == "oom":
      break


def _prefill_floor(lm, t: int) -> tuple[float, float]:
  """(bytes, FLOPs) of a one-shot prefill of t tokens: weights read, keys and values
  written; every token through the layers, the causal attention, one row of logits."""
  c = lm.config
  w_bytes, w_count = param_stats(lm)
  head = c.vocab_size * c.hidden_size
  nbytes = w_bytes + 2 * t * c.num_layers * c.num_kv_heads * c.head_dim * \
      jnp.dtype(lm.dtype).itemsize
  attention = 4 * c.num_layers * c.num_heads * c.head_dim * t * (t + 1) // 2
  return nbytes, 2 * (w_count - head) * t + 2 * head + attention


def prefill_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """Prefill seconds of one random prompt: one shot (full, snapkv) and chunked (snapkv)."""
  from kvjax import generation
  t = scale.prefill_length
  prompt = np.random.default_rng(0).integers(0, lm.config.vocab_size, t).tolist()
  nbytes, flops = _prefill_floor(lm, t)
  for policy, budget, chunk in (("full", None, 0), ("snapkv", scale.budget, 0),
                                ("snapkv", scale.budget, scale.prefill_chunk)):
    label = (f"{t:,} tokens, " + ("full cache" if budget is None else f"{policy} @ {budget}")
             + (f", chunks of {chunk}" if chunk else ", one shot"))
    try:
      kwargs = dict(policy=policy, budget=budget, max_new_tokens=1, prefill_chunk=chunk,
                    backend="auto", stop_ids=[], page_size=scale.page_size)
      first = generation.generate(lm, [prompt], **kwargs).stats  # warm-up: compiles
      best = min((generation.generate(lm, [prompt], **kwargs).stats
                  for _ in range(scale.repeats)), key=lambda s: s.prefill_s)
    except Exception as e:  # pylint: disable=broad-except
      rec.add("prefill", label, _backend_label("auto", "causal_attention"), **failure(e))
      continue
    seconds = best.prefill_s
    rec.add("prefill", label, _backend_label("auto", "causal_attention"), value=seconds,
            unit="s", seconds=seconds, policy=policy, budget=budget, prefill_chunk=chunk,
            compile_s=first.compile_s, kv_bytes=best.kv_bytes,
            **floor_fields(spec, seconds, nbytes, flops, lambda s: s))


def _equality_prompt(scale: Scale, vocab_size: int) -> tuple[list[int], tuple[int, ...]]:
  """Random token ids, about one in 12 a delimiter id (SABlock, DynSplit-KV, SentenceKV cut
  there): (prompt, delimiter ids)."""
  rng = np.random.default_rng(1)
  delimiters = (1, 2, 3)
  prompt = rng.integers(len(delimiters) + 1, vocab_size, scale.equality_prompt)
  cut = rng.random(scale.equality_prompt) < 1 / 12
  prompt[cut] = rng.choice(delimiters, int(cut.sum()))
  return prompt.tolist(), delimiters


def equality_section(rec: Recorder, scale: Scale, lm) -> None:
  """Greedy tokens of every policy with backend "pallas" against "xla" on one prompt."""
  from kvjax import generation
  from kvjax import policies
  prompt, delimiters = _equality_prompt(scale, lm.config.vocab_size)
  label_of = lambda name, budget: name if budget is None else f"{name} @ {budget}"
  for name in scale.equality_policies or policies.names():
    budget = None if name == "full" else scale.equality_budget
    fields = policies.window_fields(name, scale.window)
    if "delimiter_ids" in {f.name for f in dataclasses.fields(type(policies.get(name)))}:
      fields["delimiter_ids"] = delimiters
    tokens = {}
    try:
      policy = policies.get(name, **fields)
      for backend in ("xla", "pallas"):
        tokens[backend] = generation.generate(
            lm, [prompt], policy=policy, budget=budget, max_new_tokens=scale.equality_tokens,
            backend=backend, stop_ids=[], page_size=scale.page_size).token_ids[0]
    except Exception as e:  # pylint: disable=broad-except
      failed = "pallas" if "xla" in tokens else "xla"
      rec.add("equality", label_of(name, budget), f"pallas vs xla ({failed} failed)",
              policy=name, budget=budget, **failure(e))
      continue
    a, b = np.asarray(tokens["xla"]), np.asarray(tokens["pallas"])
    diff = np.flatnonzero(a != b) if len(a) == len(b) else [min(len(a), len(b))]
    rec.add("equality", label_of(name, budget), "pallas vs xla", policy=name, budget=budget,
            equal=len(diff) == 0, first_diff=int(diff[0]) if len(diff) else None,
            tokens=len(a), prompt_tokens=len(prompt), tokens_xla=a.tolist(),
            tokens_pallas=b.tolist())


# ------------------------------------------------------------------ report


def _cell(row: dict, key: str, unit: str = "") -> str:
  if row["status"] != "ok":
    return "—"
  return fmt(row.get(key)) + (f" {unit}" if unit and row.get(key) is not None else "")


def summary_markdown(rows: list[dict], header: list[str], sections=SECTIONS,
                     notes: list[str] = ()) -> str:
  """A table per section (rows in measuring order, a label's rows together) under
  ``header``'s lines, then ``notes``."""
  lines = list(header)
  for section in SECTIONS:
    lines += ["", f"## {TITLES[section]}", ""]
    these = [r for r in rows if r["section"] == section]
    first = {}
    for i, r in enumerate(these):
      first.setdefault(r["label"], i)
    these.sort(key=lambda r: first[r["label"]])  # a shape's rows together (auto comes last)
    if not these:
      lines.append("not run" if section not in sections else "no rows (see the log)")
      continue
    if section == "equality":
      lines += ["| policy | implementations | greedy tokens equal | tokens | note |",
                "|---|---|---|---|---|"]
      for r in these:
        ok = r["status"] == "ok"
        note = (r["error"][:160] if not ok else "" if r["equal"]
                else f"first differs at token {r['first_diff']}")
        lines.append(f"| {r['label']} | {r['impl']} | "
                     f"{fmt(r['equal']) if ok else r['status']} | "
                     f"{r.get('tokens', '—') if ok else '—'} | {note} |")
      continue
    lines += ["| measurement | implementation | now | floor | of floor | note |",
              "|---|---|---|---|---|---|"]
    for r in these:
      note = (f"{r['status'].upper()}: {r['error'][:160]}" if r["status"] != "ok"
              else f"{r['floor_bound']}-bound" if r.get("floor_bound") else "")
      if section == "kernel" and r["status"] == "ok":
        note = ", ".join(filter(None, [f"{fmt(1e3 * r['seconds'])} ms", note]))
      lines.append(f"| {r['label']} | {r['impl']} | {_cell(r, 'value', r.get('unit', ''))} | "
                   f"{_cell(r, 'floor', r.get('unit', ''))} | {_cell(r, 'of_floor')} | "
                   f"{note} |")
  if notes:
    lines += ["", "## What auto runs", "", *notes]
  return "\n".join(lines) + "\n"


def _header(kind: str, spec: DeviceSpec | None, scale: Scale, scan_layers: bool,
            seconds: float) -> list[str]:
  c, eq = model_config(scale.model), model_config(scale.equality_model)
  floor = ("n/a: this chip is not in `kvjax.bench.accelerator.SPECS`" if spec is None else
           f"{spec.name}: {spec.hbm_bytes_per_s / 1e12:g} TB/s HBM, "
           f"{spec.bf16_flops_per_s / 1e12:g} TFLOP/s dense bf16 ({spec.source})")
  return [
      f"# kvjax against the physical floor: {kind} ({jax.default_backend()})", "",
      f"`python -m kvjax.bench --preset=accelerator --scale={scale.name}`, jax "
      f"{jax.__version__}, {seconds:.0f} s in all.",
      f"Model: random {c.name} shape ({c.num_layers} layers, N={c.num_heads} "
      f"K={c.num_kv_heads} H={c.head_dim}, D={c.hidden_size}), {scale.dtype}, layers "
      f"{'scanned' if scan_layers else 'unrolled'}; page size {scale.page_size}; "
      f"{scale.decode_steps} decode steps, best of {scale.repeats} after a warm-up.",
      f"Floor: max(bytes moved / HBM bandwidth, FLOPs / peak); {floor}. "
      "`of floor`: floor time / measured time (1 = at the floor). Decode bytes: the "
      "weights plus the kept keys and values, per step.",
      f"Equality: random {eq.name} shape, float32, a {scale.equality_prompt}-token prompt "
      f"of random ids, {scale.equality_tokens} greedy tokens, budget "
      f"{scale.equality_budget}.",
  ] + (["", "**Small scale**: toy shapes, Pallas in its interpreter: a check that "
        "every section runs, not a measurement of speed."] if scale.name == "small" else [])


def run(out: str | pathlib.Path = "results/accelerator", *, scale: str = "auto",
        sections=SECTIONS, scan_layers: bool | None = None,
        install: bool | None = None) -> list[dict]:
  """Runs the chosen sections; writes results.jsonl, summary.md and (kernel section)
  auto_choices.json in ``out``; returns rows.

  ``scan_layers``: the models' layer layout (None: the device's default,
  ``kvjax.models.llama.default_scan_layers``). ``install``: whether the kernel
  section's choices become this device kind's measured choices for "auto"
  (None: at full scale off a CPU).
  """
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    raise ValueError(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
  from kvjax.models import lm as lm_lib
  from kvjax.models import llama
  scan_layers = llama.default_scan_layers(scan_layers)
  sc = scale_for(scale)
  out = pathlib.Path(out)
  kind = jax.devices()[0].device_kind
  spec = device_spec(kind)
  if install is None:
    install = sc.name == "full" and jax.default_backend() != "cpu"
  rec = Recorder(out, {"device_kind": kind, "platform": jax.default_backend(),
                       "scale": sc.name, "scan_layers": scan_layers})
  print(f"kvjax accelerator preset ({sc.name} scale) on {kind}: sections "
        f"{', '.join(sections)}; rows in {rec.path}", flush=True)
  models = {}

  def model(name, dtype):  # built on first use, one at a time (device memory)
    if name not in models:
      models.clear()
      models[name] = lm_lib.init_random(model_config(name), dtype=jnp.dtype(dtype),
                                        scan_layers=scan_layers)
    return models[name]

  steps = {
      "kernel": lambda: kernel_section(rec, sc, spec, out / "auto_choices.json", install),
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
  text = summary_markdown(rec.rows, _header(kind, spec, sc, scan_layers,
                                            time.perf_counter() - rec.start), sections,
                          rec.notes)
  (out / "summary.md").write_text(text)
  print(text, flush=True)
  return rec.rows
