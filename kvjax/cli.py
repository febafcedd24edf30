"""What the command-line tools share: flag errors on one line with exit code 2, quiet logs.

Used by ``kvjax.eval`` and ``kvjax.bench`` (the library itself never imports it).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from absl import app
from absl import flags

from kvjax import backend
from kvjax import runtime

# "0" skips kvjax.runtime.setup() in the tools.
RUNTIME_SETUP_ENV = "KVJAX_RUNTIME_SETUP"


def fail(message: str) -> None:
  """Prints ``error: message`` on stderr and exits with code 2 (a usage error)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def quiet_logs() -> None:
  """absl shows INFO logs; JAX's and matplotlib's are noise on a command line."""
  for noisy in ("jax", "matplotlib"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def run(main: Callable) -> None:
  """``app.run(main)`` with a bad flag reported by ``fail``, not a usage dump.

  The tool's process is set up first (``kvjax.runtime.setup``): its peak
  memory is what it holds. ``KVJAX_RUNTIME_SETUP=0`` in the environment leaves
  the process as it is (to measure what the setup changes; the bench's
  child processes inherit it). ``--backend=native`` where the C++ kernels do
  not build is a bad flag too: its reason on one line.
  """
  if os.environ.get(RUNTIME_SETUP_ENV, "1") != "0":
    runtime.setup()
  try:
    app.run(main, flags_parser=_parse_flags)
  except backend.NativeUnavailable as e:
    fail(str(e))
