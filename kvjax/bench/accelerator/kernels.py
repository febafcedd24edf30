"""The kernel section: per op, every implementation's speed at the op's shapes, then
"auto"'s choice (the fastest eligible one) and what "auto" runs."""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from kvjax import backend_choices
from kvjax.bench.accelerator import choices as choices_lib
from kvjax.bench.accelerator.recorder import Recorder
from kvjax.bench.accelerator.recorder import backend_label
from kvjax.bench.accelerator.recorder import failure
from kvjax.bench.accelerator.scales import Scale
from kvjax.bench.accelerator.scales import command
from kvjax.bench.accelerator.specs import DeviceSpec
from kvjax.bench.accelerator.specs import floor_fields

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


def time_call(fn, args: tuple, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after a warm-up call (which compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


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
  dtype = jnp.dtype(scale.dtype)
  names = implementations(op, dtype)
  timings = []
  for shape in shapes:
    case = make_case(shape, dtype, scale.page_size)
    seconds = {name: _time_row(rec, scale, spec, case, name, jax.jit(_here(op, name)),
                               case.args)
               for name in names}
    if yardstick is not None:
      yardstick(rec, scale, spec, case)
    timings.append({"shape": case.label, "seconds": seconds})
    del case
  return backend_choices.measured_entry(timings, platform=jax.default_backend(),
                                        command=command(scale))


def kernel_section(rec: Recorder, scale: Scale, spec: DeviceSpec | None,
                   choices: pathlib.Path | None = None) -> dict:
  """Per op, every implementation's speed, then "auto"'s choice and what "auto" runs.

  The choices go to ``choices`` (when given) as each op is measured. The
  "auto" rows time what "auto" runs for a caller, the committed table's
  choice unless ``$KVJAX_AUTO_CHOICES`` names a file (``kvjax.backend_choices``):
  a measurement changes "auto" only where it is named. Returns op -> measured entry.
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
      if choices is not None:
        choices_lib.save_choices(rec, kind, platform, entries, choices)
    auto = _here(op, backend.resolve("auto", op, platform=platform))
    for shape in shapes:
      case = make_case(shape, jnp.dtype(scale.dtype), scale.page_size)
      _time_row(rec, scale, spec, case, backend_label("auto", op), jax.jit(auto), case.args)
  choices_lib.report_choices(rec, scale, kind, platform, entries, choices)
  return entries


def _here(op: str, name: str):
  """``op``'s implementation ``name``, built for this machine's default platform."""
  from kvjax import backend
  platform = jax.default_backend()
  return backend.implementation(op, name, platform=platform, interpret=platform == "cpu")
