"""The opt-in set-up of a process that runs kvjax: ``kvjax.runtime.setup()``.

The library changes nothing process-wide: ``import kvjax; kvjax.generate(...)``
leaves the C allocator and XLA's compiler options as it found them. A process
that is about running kvjax (the command-line tools, the benchmarks, a
script that wants their memory figures) calls ``setup()`` once, at start:

- glibc's allocator maps blocks of 1 MiB and more in pages of their own and
  keeps one heap arena for every thread (``kvjax.host_memory``), so the memory
  a program run or a compilation frees goes back to the system instead of
  staying resident under what runs next;
- generate's programs compile on a CPU with XLA options that hold less memory
  while compiling (the classic emitters instead of the fusion emitters) and,
  for the chunk and decode programs, while running (the memory-optimized
  scheduler), at the same speed.

The figures, with the commands that measured them, are in
docs/results/bench_prefill_8k.md. ``setup()`` may be called again (it sets
the same values); it cannot be undone within the process.
"""

from __future__ import annotations

from kvjax import host_memory

# Programs whose scratch XLA's memory-optimized scheduler shrinks; the one-shot
# prefill's grew under it, so it keeps the default schedule.
_LEAN_SCHEDULE = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

# kvjax.generation.compile.cpu_compiler_options as setup() fills it ("*": every program).
CPU_COMPILER_OPTIONS = {
    "*": {"xla_cpu_use_fusion_emitters": False},
    "prefill_chunk": _LEAN_SCHEDULE,
    "decode": _LEAN_SCHEDULE,
}


def setup() -> dict[str, bool]:
  """Sets this process up for kvjax runs (see the module docstring); call it at start.

  The heap arena limit applies to arenas not yet created, so the earlier the
  better: before other threads allocate.

  Returns:
    What took effect: {"mmap_threshold", "single_arena"} (False where there is
    no glibc ``mallopt``), "cpu_compiler_options" (always True).
  """
  applied = {"mmap_threshold": host_memory.map_large_blocks(),
             "single_arena": host_memory.single_arena()}
  # Imported when called: importing this module (kvjax.cli does) loads no generation code.
  from kvjax.generation import compile as compile_lib  # pylint: disable=g-import-not-at-top
  for program, options in CPU_COMPILER_OPTIONS.items():
    compile_lib.cpu_compiler_options[program] = dict(options)
  applied["cpu_compiler_options"] = True
  return applied
