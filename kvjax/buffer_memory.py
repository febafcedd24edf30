"""The peak of live jax buffers over a run's programs: what a device allocator would peak at.

On GPU and TPU ``memory_stats()`` reports the allocator's peak; the CPU client
has no such counter, and the process's resident set there also holds the
runtime, the compiler and the heap's leftovers. This measures the buffers
alone, on any backend: before each program of ``kvjax.generate`` runs, the
bytes of every live jax array (its arguments among them) plus what the
program allocates while it runs (``memory_analysis()``: its scratch, and the
outputs that do not reuse a donated argument's buffer). The largest sum over
the programs is the peak; eager ops between programs (a cache's creation, a
logits select) are not observed, but what they leave is live at the next one.

  with kvjax.buffer_memory.track() as peak:
    kvjax.generate(lm, prompts, policy="snapkv", budget=1024, prefill_chunk=512)
  print(peak.bytes)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax

_TRACKERS: list["BufferPeak"] = []


@dataclasses.dataclass
class BufferPeak:
  """The largest live-buffer total seen so far (bytes), and at which program."""

  bytes: int = 0
  program: str | None = None


@contextlib.contextmanager
def track() -> Iterator[BufferPeak]:
  """Observes every program run inside the block (trackers may nest).

  Every live array in the process counts, the model's weights and arrays the
  run does not own among them, as they would on a device.
  """
  peak = BufferPeak()
  _TRACKERS.append(peak)
  try:
    yield peak
  finally:
    _TRACKERS.remove(peak)


def observe(program, name: str) -> None:
  """Records the buffers ``program`` (compiled) will hold with it; call just before it runs."""
  if not _TRACKERS:
    return
  total = live_bytes() + running_bytes(program)
  for peak in _TRACKERS:
    if total > peak.bytes:
      peak.bytes, peak.program = total, name


def live_bytes() -> int:
  """Bytes of every live jax array, each buffer once (all devices)."""
  seen, total = set(), 0
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      buffer = shard.data
      try:  # two arrays may hold one buffer
        key = (buffer.unsafe_buffer_pointer(), buffer.nbytes)
      except Exception:  # pylint: disable=broad-except  (no raw pointers here: count it)
        total += buffer.nbytes
        continue
      if key not in seen:
        seen.add(key)
        total += buffer.nbytes
  return total


def running_bytes(program) -> int:
  """What a compiled program allocates as it runs: scratch, and outputs not in a donated input."""
  stats = program.memory_analysis()
  return (stats.temp_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes)
