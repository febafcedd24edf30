"""The equality section: greedy tokens with backend "pallas" equal to "xla", per policy."""

from __future__ import annotations

import numpy as np

from kvjax.bench.accelerator.recorder import Recorder
from kvjax.bench.accelerator.recorder import failure
from kvjax.bench.accelerator.scales import Scale


def _equality_prompt(scale: Scale, vocab_size: int) -> tuple[list[int], tuple[int, ...]]:
  """Random token ids, about one in 12 a delimiter id (SABlock, DynSplit-KV, SentenceKV cut
  there): (prompt, delimiter ids)."""
  rng = np.random.default_rng(1)
  delimiters = (1, 2, 3)
  prompt = rng.integers(len(delimiters) + 1, vocab_size, scale.equality_prompt)
  cut = rng.random(scale.equality_prompt) < 1 / 12
  prompt[cut] = rng.choice(delimiters, int(cut.sum()))
  return prompt.tolist(), delimiters


def equality_section(rec: Recorder, scale: Scale, lm) -> None:
  """Greedy tokens of every policy with backend "pallas" against "xla" on one prompt."""
  from kvjax import generation
  from kvjax import policies
  prompt, delimiters = _equality_prompt(scale, lm.config.vocab_size)
  label_of = lambda name, budget: name if budget is None else f"{name} @ {budget}"
  for name in scale.equality_policies or policies.names():
    budget = None if name == "full" else scale.equality_budget
    fields = policies.window_fields(name, scale.window)
    if hasattr(policies.get(name), "delimiter_ids"):
      fields["delimiter_ids"] = delimiters
    tokens = {}
    try:
      policy = policies.get(name, **fields)
      for backend in ("xla", "pallas"):
        tokens[backend] = generation.generate(
            lm, [prompt], policy=policy, budget=budget, max_new_tokens=scale.equality_tokens,
            backend=backend, stop_ids=[], page_size=scale.page_size).token_ids[0]
    except Exception as e:  # pylint: disable=broad-except
      failed = "pallas" if "xla" in tokens else "xla"
      rec.add("equality", label_of(name, budget), f"pallas vs xla ({failed} failed)",
              policy=name, budget=budget, **failure(e))
      continue
    a, b = np.asarray(tokens["xla"]), np.asarray(tokens["pallas"])
    diff = np.flatnonzero(a != b) if len(a) == len(b) else [min(len(a), len(b))]
    rec.add("equality", label_of(name, budget), "pallas vs xla", policy=name, budget=budget,
            equal=len(diff) == 0, first_diff=int(diff[0]) if len(diff) else None,
            tokens=len(a), prompt_tokens=len(prompt), tokens_xla=a.tolist(),
            tokens_pallas=b.tolist())
