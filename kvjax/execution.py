"""What a traced program is built for, as one explicit value.

An ``Execution`` names, per kernel op, the implementation that runs it (the
XLA reference, the Pallas kernel or the CPU's native one), the platform the
program is built for, and the device-mesh axes its reductions span. It is a
frozen, hashable value: generation passes it to every program as a static
argument, and the programs hand it down to the cache's attention entry
points, the models and the policies, as JAX's Pallas ops take ``interpret=``
and block sizes. Nothing that traces reads an ambient setting.

  ex = execution.create("auto")            # per op, what the committed table chose here
  ex = execution.create("pallas", platform="tpu")   # to lower for a TPU from a CPU
  ex.impl("paged_attention")(q, k_pages, v_pages, page_table, lengths)
  ex.axes.heads_sum(scores, 1)             # over every KV head, on a mesh or not

``ambient()`` builds one from ``kvjax.backend.use`` and
``kvjax.kernels.platform.targeting``: sugar for a user's own traced code that
calls the cache's entry points without an ``ex``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from kvjax import backend as backend_lib
from kvjax.kernels import platform as platform_lib
from kvjax.sharding.collectives import MeshAxes


@dataclasses.dataclass(frozen=True)
class Execution:
  """Kernels per op, target platform and mesh axes of one traced program.

  Build one with ``create``; ``Execution()`` runs every op's XLA reference.
  """

  backend: str = "xla"  # what was asked for: "auto", "xla", "pallas" or "native"
  platform: str = "cpu"  # the platform programs are built for (jax.default_backend() names)
  ops: tuple[tuple[str, str], ...] = ()  # (op, implementation); ops not listed run "xla"
  axes: MeshAxes = MeshAxes()  # mesh axes of sequences and KV heads; none off a mesh

  @property
  def interpret(self) -> bool:
    """Whether Pallas kernels run in the interpreter: built for a CPU, nothing compiles them."""
    return self.platform == "cpu"

  def choice(self, op: str) -> str:
    """The implementation that runs ``op`` ("xla", "pallas", "native", "fused")."""
    return dict(self.ops).get(op, "xla")

  def impl(self, op: str) -> Callable:
    """``op``'s implementation, with the reference's signature."""
    return backend_lib.implementation(op, self.choice(op), platform=self.platform,
                                      interpret=self.interpret)

  def on_mesh(self, data: str | None, model: str | None) -> "Execution":
    """This execution with sequences split over ``data`` and KV heads over ``model``."""
    return dataclasses.replace(self, axes=MeshAxes(data, model))

  def local(self) -> "Execution":
    """This execution with every reduction local: for arrays whose rows are not a
    batch's sequences and a layer's KV heads (a chunked prefill compresses each
    (sequence, KV head) as a one-head sequence of its own)."""
    return dataclasses.replace(self, axes=MeshAxes())


def create(backend: str = "xla", *, platform: str | None = None,
           choices=None) -> Execution:
  """The execution that runs each op as ``backend`` says, built for ``platform``.

  Args:
    backend: "auto" (per op, the committed table's choice for the platform,
      ``kvjax.backend_choices``), "xla", "pallas" or "native" (``kvjax.backend``).
    platform: "cpu", "gpu" or "tpu"; None: the default device's (or
      ``targeting``'s, where a user set one).
    choices: a measured-choices file for "auto" to prefer to the committed
      table (``kvjax.backend_choices``); None: the one named by the
      environment, if any.

  Raises:
    ValueError: an unknown backend or platform, or "native" off a CPU.
    kvjax.backend.NativeUnavailable: "native" where the C++ kernels do not build.
  """
  if backend not in backend_lib.BACKENDS:
    raise ValueError(f"backend must be one of {backend_lib.BACKENDS}, got {backend!r}")
  platform = platform or platform_lib.ambient_target() or jax.default_backend()
  if platform not in platform_lib.PLATFORMS:
    raise ValueError(f"platform must be one of {platform_lib.PLATFORMS}, got {platform!r}")
  ops = tuple((op, backend_lib.resolve(backend, op, platform=platform, choices=choices))
              for op in backend_lib.ops())
  return Execution(backend, platform, ops)


def ambient() -> Execution:
  """The execution ``kvjax.backend.use`` and ``targeting`` describe (XLA outside them).

  For a user's own traced code only: the library's programs take theirs as an
  argument.
  """
  return create(backend_lib.current())


def of(ex: Execution | None) -> Execution:
  """``ex``, or the ambient one where a user's own code passed none."""
  return ambient() if ex is None else ex
