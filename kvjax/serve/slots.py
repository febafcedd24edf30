"""The decode program's per-slot arrays, kept on the host between dispatches."""

from __future__ import annotations

import numpy as np

from kvjax.serve.requests import Request


class SlotArrays:
  """What ``programs.decode`` reads and writes of each of S slots.

  last [S] the token to feed next, positions [S] its position, active [S] bool,
  remaining [S] tokens still to generate, temperature [S], top_k [S] (0: every token), seeds [S], stops [S, M] stop ids
  (-1 pads). An idle slot (empty, or a prompt still being prefilled) is inactive.
  """

  def __init__(self, size: int, num_stops: int):
    self.size, self.num_stops = size, num_stops
    self.arrays = {
        "last": np.zeros(size, np.int32), "positions": np.zeros(size, np.int32),
        "active": np.zeros(size, bool), "remaining": np.zeros(size, np.int32),
        "temperature": np.zeros(size, np.float32), "top_k": np.zeros(size, np.int32),
        "seeds": np.zeros(size, np.uint32), "stops": np.full((size, num_stops), -1, np.int32)}

  def _set(self, slot: int, **values) -> None:
    # The arrays may be the device's outputs of the last dispatch: copy to write.
    arrays = {k: np.array(v) for k, v in self.arrays.items()}
    for name, value in values.items():
      arrays[name][slot] = value
    self.arrays = arrays

  def start(self, slot: int, request: Request, first: int) -> bool:
    """Sets the slot running from its first token; True if that token ends it."""
    stops = np.full(self.num_stops, -1, np.int32)
    ids = request.stop_ids[:self.num_stops]
    stops[:len(ids)] = ids
    ended = first in request.stop_ids or request.max_tokens == 1
    self._set(slot, last=first, positions=len(request.ids), active=not ended,
              remaining=request.max_tokens - 1, temperature=request.temperature,
              top_k=request.top_k, seeds=request.seed, stops=stops)
    return ended

  def stop(self, slot: int) -> None:
    self._set(slot, active=False, remaining=0)

  def active(self) -> np.ndarray:
    return np.asarray(self.arrays["active"])
