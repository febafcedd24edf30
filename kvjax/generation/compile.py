"""Compiling generate's programs once per (static configuration, shapes), and timing their runs.

A program is compiled ahead of time (``jax.jit(...).lower(...).compile()``) so
its compile time is reported apart from its run time, and kept in a
process-wide table keyed by its name, its static arguments and the shapes of
its arguments: prompts padded to the same length, and any temperature or seed,
reuse one program.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kvjax import buffer_memory

# Names of generate's programs (``kvjax.generation.programs``).
PROGRAM_NAMES = ("prefill", "prefill_chunk", "record", "score", "store", "extend", "decode")

# Programs compiled so far: generate's per name, other callers' per module.name.
COMPILE_COUNT = dict.fromkeys(PROGRAM_NAMES, 0)

# XLA compile options for the programs on a CPU: program name -> options, "*"
# for every program (a program's own entries win). Empty: XLA's defaults.
# ``kvjax.runtime.setup()`` fills it for processes that opt in.
cpu_compiler_options: dict[str, dict[str, Any]] = {}

# (name, statics, argument structure, argument shapes) -> compiled program.
_PROGRAMS: dict = {}


def compile_lowered(lowered: jax.stages.Lowered, name: str) -> jax.stages.Compiled:
  """``lowered.compile()``, on a CPU with the ``cpu_compiler_options`` of program ``name``.

  An XLA that lacks an option compiles with its defaults.
  """
  options = {**cpu_compiler_options.get("*", {}), **cpu_compiler_options.get(name, {})}
  if not options or jax.default_backend() != "cpu":
    return lowered.compile()
  try:
    return lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:  # an XLA without them
    if "No such compile option" not in str(e) and "not a valid enum value" not in str(e):
      raise
    return lowered.compile()


def compiled(fn: Callable, args: tuple, statics: dict, mesh=None, kinds=None
             ) -> tuple[jax.stages.Compiled, float]:
  """The compiled program of ``fn`` for these statics and argument shapes.

  ``args`` may be abstract (``jax.ShapeDtypeStruct``), to compile before the
  arrays exist. Argument 1 (the cache) is donated so XLA updates the page
  pool in place. A ``mesh`` (not None) compiles the program to run per
  device on that mesh (``kvjax.sharding.programs``), its arguments and results
  laid out as ``kinds`` says (None: generate's, ``programs.MESH_KINDS``).

  Returns:
    (the program, seconds spent compiling now: 0 when it was compiled before).
  """
  name = fn.__name__
  shapes = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), args)
  key = (name, tuple(sorted(statics.items(), key=lambda kv: kv[0])), mesh,
         jax.tree.structure(args), tuple(jax.tree.leaves(shapes)), fn.__module__)
  if key in _PROGRAMS:
    return _PROGRAMS[key], 0.0
  start = time.perf_counter()
  if mesh is None:
    jitted = jax.jit(functools.partial(fn, **statics), donate_argnums=(1,))
    program = compile_lowered(jitted.lower(*args), name)
  else:
    from kvjax.generation.programs import MESH_KINDS
    from kvjax.sharding import programs as mesh_programs
    program = mesh_programs.compile(fn, args, statics, mesh, kinds or MESH_KINDS[name],
                                    functools.partial(compile_lowered, name=name))
  _PROGRAMS[key] = program
  counted = name if kinds is None else f"{fn.__module__}.{name}"
  COMPILE_COUNT[counted] = COMPILE_COUNT.get(counted, 0) + 1
  return program, time.perf_counter() - start


def clear_programs() -> None:
  """Forgets every compiled program, so their memory and code can be freed.

  A long-lived process that compiles many configurations (a test session,
  a sweep over shapes) otherwise keeps each one, with its machine code, for
  the rest of the process.
  """
  _PROGRAMS.clear()


class Clock:
  """Seconds of one generate run: compiling, and running programs per phase."""

  def __init__(self, seconds: dict[str, float] | None = None, compile_s: float = 0.0):
    self.seconds = dict(seconds or {})  # phase ("prefill", "decode") -> run seconds
    self.compile_s = compile_s

  def compile(self, fn: Callable, args: tuple, statics: dict, mesh=None
              ) -> jax.stages.Compiled:
    """The compiled program (see ``compiled``), counting the seconds it took to compile now."""
    program, seconds = compiled(fn, args, statics, mesh)
    self.compile_s += seconds
    return program

  def run(self, phase: str, fn: Callable, args: tuple, statics: dict, mesh=None) -> Any:
    """Runs ``fn``'s program on ``args`` to completion; its seconds count under ``phase``."""
    program = self.compile(fn, args, statics, mesh)
    buffer_memory.observe(program, fn.__name__)
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
    return out
