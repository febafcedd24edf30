"""Chips' published peak figures, and a measurement's floor: the least time the chip
could take to move its bytes and do its FLOPs."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable


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
