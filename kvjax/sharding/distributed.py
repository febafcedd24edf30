"""Several processes, one mesh: JAX's multi-controller runtime, set up for kvjax.

Every process runs the same program (the same ``generate`` call on the same
prompts); ``jax.distributed`` connects them, ``jax.devices()`` then lists every
process's devices, and a mesh over them (``make_mesh``) spans the hosts. Each
process lays out its own devices' parts of the weights and inputs, and reads
the generated tokens, which every process receives whole.

  TPU slice     kvjax.sharding.initialize()            (the runtime finds its peers)
  GPU hosts     kvjax.sharding.initialize("host0:1234", num_processes=2, process_id=i)
  CPU (tests)   as for GPU hosts, with local_device_count=4: gloo collectives
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator_address: str | None = None, *, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None) -> None:
  """Joins this process to the others (``jax.distributed.initialize``); call it first.

  Args:
    coordinator_address: "host:port" of process 0; None where the platform
      finds it (TPU slices, SLURM and Open MPI jobs).
    num_processes, process_id: this job's size and this process's rank.
    local_device_count: CPU only: the devices this process simulates
      (``--xla_force_host_platform_device_count``); CPU collectives across
      processes then go through gloo. Must be called before JAX starts.

  This changes process-wide JAX state, as ``jax.distributed.initialize``
  does: it is for a program's entry point (the CLIs' ``--coordinator`` flags
  call it), never for library code.
  """
  if local_device_count is not None:
    flag = f"--xla_force_host_platform_device_count={int(local_device_count)}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id)
