"""Timing and reporting shared by the kernel microbenchmarks.

Each benchmark times three implementations of one op on the same inputs:
  kernel     the Pallas kernel (interpreted on CPU: a correctness path, not a
             speed one; on GPU/TPU compiled for the chip)
  reference  the float32 jnp reference under jax.jit (the "xla" backend)
  plain XLA  what one writes without the kernel or the paged layout
and prints the bytes each one must move divided by its median wall time.
"""

from __future__ import annotations

import statistics
import time

import jax


def interpret() -> bool:
  """Pallas kernels are interpreted on CPU (nothing compiles them there)."""
  return jax.default_backend() == "cpu"


def time_fn(fn, make_args, *, repeats: int) -> float:
  """Median seconds of ``fn(*make_args())`` after one warm-up (compile) call.

  ``make_args`` runs outside the timed region (fresh buffers for donating ops).
  """
  jax.block_until_ready(fn(*make_args()))
  times = []
  for _ in range(repeats):
    args = make_args()
    jax.block_until_ready(args)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def report(title: str, sizes: str, nbytes: int, rows: list[tuple[str, float]]) -> None:
  """Prints one line per implementation: median time and achieved bytes/s."""
  print(f"{title} on {jax.default_backend()} ({jax.devices()[0].device_kind}); {sizes}")
  print(f"  bytes moved per call: {nbytes / 1e6:.3f} MB")
  if interpret():
    print("  NOTE: on CPU the Pallas kernel runs in Pallas' INTERPRETER; its figure "
          "measures the interpreter, not the kernel")
  for name, seconds in rows:
    print(f"  {name:<28} {seconds * 1e3:10.3f} ms   {nbytes / seconds / 1e9:10.4f} GB/s")
