"""The sections that time the whole model: decode steps at batch 1, throughput by batch
(both on synthetic caches, ``runner.synthetic_decode``) and the prefill of a prompt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.accelerator.recorder import Recorder
from kvjax.bench.accelerator.recorder import backend_label
from kvjax.bench.accelerator.recorder import failure
from kvjax.bench.accelerator.recorder import policy_label
from kvjax.bench.accelerator.scales import Scale
from kvjax.bench.accelerator.specs import floor_fields


def param_stats(lm) -> tuple[int, int]:
  """(bytes, count) of the model's weights: a decode step reads every one once."""
  leaves = jax.tree.leaves(lm.params)
  return sum(x.nbytes for x in leaves), sum(x.size for x in leaves)


def _decode_row(rec, section, label, impl, lm, cfg, spec, to_value, unit) -> dict:
  """Decodes ``cfg`` on a synthetic cache; a row with ms/step or tokens/s and the floor."""
  from kvjax import policies
  from kvjax.bench import runner
  try:
    policy = policies.get(cfg.policy)
    budgets = runner.cache_budgets(lm, cfg, policy)
    m = runner.synthetic_decode(lm, cfg, policy)
  except Exception as e:  # pylint: disable=broad-except
    return rec.add(section, label, impl, **failure(e))
  c = lm.config
  w_bytes, w_count = param_stats(lm)
  entries = cfg.batch_size * c.num_kv_heads * sum(budgets)  # kept entries read per step
  nbytes = w_bytes + 2 * entries * c.head_dim * jnp.dtype(lm.dtype).itemsize
  flops = 2 * w_count * cfg.batch_size + 4 * entries * c.group_size * c.head_dim
  seconds = m["decode_s"] / m["steps"]
  return rec.add(section, label, impl, value=to_value(seconds), unit=unit, seconds=seconds,
                 batch_size=cfg.batch_size, context_length=cfg.context_length,
                 policy=cfg.policy, budget=cfg.budget, backend=cfg.backend,
                 kv_bytes=m["kv_bytes"], compile_s=m["compile_s"],
                 **floor_fields(spec, seconds, nbytes, flops, to_value))


def _bench_config(scale: Scale, lm_name: str, **fields):
  from kvjax.bench import runner
  return runner.BenchConfig(model=lm_name, decode_steps=scale.decode_steps + 1,
                            repeats=scale.repeats, fill="synthetic",
                            page_size=scale.page_size, **fields)


def decode_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """ms per decode step, batch 1: full cache vs the budget, per context and backend."""
  for n in scale.contexts:
    for policy, budget in (("full", None), ("snapkv", scale.budget)):
      label = f"{n:,} tokens, " + policy_label(policy, budget)
      for name in ("xla", "pallas", "auto"):
        cfg = _bench_config(scale, lm.config.name, policy=policy, budget=budget,
                            context_length=n, batch_size=1, backend=name)
        _decode_row(rec, "decode", label, backend_label(name), lm, cfg, spec,
                    lambda t: 1e3 * t, "ms/step")


def throughput_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """Tokens/s at one context and budget by batch, until the first out-of-memory."""
  n = scale.throughput_context
  for batch in scale.batches:
    cfg = _bench_config(scale, lm.config.name, policy="snapkv", budget=scale.budget,
                        context_length=n, batch_size=batch, backend="auto")
    row = _decode_row(rec, "throughput", f"{n:,} tokens, snapkv @ {scale.budget}, "
                      f"batch {batch}", backend_label("auto"), lm, cfg, spec,
                      lambda t, b=batch: b / t, "tokens/s")
    if row["status"] == "oom":
      break


def _prefill_floor(lm, t: int) -> tuple[float, float]:
  """(bytes, FLOPs) of a one-shot prefill of t tokens: weights read, keys and values
  written; every token through the layers, the causal attention, one row of logits."""
  c = lm.config
  w_bytes, w_count = param_stats(lm)
  head = c.vocab_size * c.hidden_size
  nbytes = w_bytes + 2 * t * c.num_layers * c.num_kv_heads * c.head_dim * \
      jnp.dtype(lm.dtype).itemsize
  attention = 4 * c.num_layers * c.num_heads * c.head_dim * t * (t + 1) // 2
  return nbytes, 2 * (w_count - head) * t + 2 * head + attention


def prefill_section(rec: Recorder, scale: Scale, spec, lm) -> None:
  """Prefill seconds of one random prompt: one shot (full, snapkv) and chunked (snapkv)."""
  from kvjax import generation
  t = scale.prefill_length
  prompt = np.random.default_rng(0).integers(0, lm.config.vocab_size, t).tolist()
  nbytes, flops = _prefill_floor(lm, t)
  impl = backend_label("auto", "causal_attention")
  for policy, budget, chunk in (("full", None, 0), ("snapkv", scale.budget, 0),
                                ("snapkv", scale.budget, scale.prefill_chunk)):
    label = (f"{t:,} tokens, " + policy_label(policy, budget)
             + (f", chunks of {chunk}" if chunk else ", one shot"))
    try:
      kwargs = dict(policy=policy, budget=budget, max_new_tokens=1, prefill_chunk=chunk,
                    backend="auto", stop_ids=[], page_size=scale.page_size)
      first = generation.generate(lm, [prompt], **kwargs).stats  # warm-up: compiles
      best = min((generation.generate(lm, [prompt], **kwargs).stats
                  for _ in range(scale.repeats)), key=lambda s: s.prefill_s)
    except Exception as e:  # pylint: disable=broad-except
      rec.add("prefill", label, impl, **failure(e))
      continue
    seconds = best.prefill_s
    rec.add("prefill", label, impl, value=seconds,
            unit="s", seconds=seconds, policy=policy, budget=budget, prefill_chunk=chunk,
            compile_s=first.compile_s, kv_bytes=best.kv_bytes,
            **floor_fields(spec, seconds, nbytes, flops, lambda s: s))
