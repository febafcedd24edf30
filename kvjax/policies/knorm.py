"""A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (KNorm,
arXiv 2406.11430).

Keys with a low L2 norm draw high attention, so each head keeps the keys
with the lowest norm. No attention is computed.

Parameters: none besides the budget.

Ours where the paper is silent: keys are scored as cached, after RoPE
(kvpress's KnormPress does the same; rotations preserve norms), and no
window or sink is forced.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.policies import scoring
from kvjax.policies.base import Policy


@dataclasses.dataclass(frozen=True)
class KNorm(Policy):
  """Keeps the keys with the lowest L2 norm (kvpress KnormPress). No attention needed."""

  name: ClassVar[str] = "knorm"

  def score(self, ex, prompt, q, k, v):
    """s[b, h, t] = -||k[b, t, h]||_2 ([B, K, T]); padding -inf."""
    return scoring.mask_padding(-ex.impl("token_norms")(k), prompt.lengths)
