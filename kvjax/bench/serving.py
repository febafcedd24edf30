r"""A serving benchmark: task prompts arriving at a rate, replayed against ``kvjax.serve.Engine``.

  python -m kvjax.bench --preset=serving --serving_policies=full,snapkv:512,sablock:512 \
      --serving_prompt_tokens=4096 --serving_pool=4 --serving_requests=32 --serving_rate=inf

In the manner of vLLM's benchmark_serving: N requests whose prompts are the
evaluation's tasks (``kvjax.tasks.niah``: "passkey" hides a pass key in
repeated filler, "niah" a magic number in natural text), so that every
completion is scored with its task's metric, arrive by a Poisson process at
``rate`` requests per second (``inf``: all at once), drawn from one seed.
Every configuration (a policy and its budget) gets the same requests at the
same times and the same page pool: ``num_pages`` or ``kv_memory`` bytes, or
``full_cache_pool`` to size it as a number of full-cache requests of the
longest kind. A policy that keeps fewer entries per request needs fewer pages
for each, so more of them can run at once in the same memory.

Each configuration builds its engine, warms it up (its programs compiled on
the workload's longest and shortest prompt, not timed), then replays the
arrivals against the wall clock: a host loop submits every request whose
arrival time has passed, then runs one ``engine.step()``. A request's first
token is seen after the step in which ``engine.tokens_of`` turns non-empty
(or it ended), its end after the step that returned its completion. So:

  TTFT   first token - arrival (a request that arrives during a step waits
         for it, as it would in a server's queue)
  TPOT   (end - first token) / (tokens - 1), per request of two tokens or more
  tokens/s, requests/s   over the run: from the first arrival to the last end
  concurrency   the requests that ran in a step (those running after it and
         those that ended in it): the peak, and the mean over the run's time
  pages  the pages the step ran with: those in use after it, plus those the
         requests that ended in it held (their prompt and tokens' pages)

``kvjax.bench.serving_report`` writes the table and the plot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Sequence

import numpy as np

from kvjax.eval import metrics as metrics_lib
from kvjax.eval import policy_entries
from kvjax.tasks import niah
from kvjax.tasks.sample import Sample

# --serving_task -> the haystack of the single-needle NIAH task.
TASKS = {"passkey": "repeat", "niah": "natural"}
# Rows of a run in progress; replaces results.jsonl when every configuration has run.
PARTIAL = "results.partial.jsonl"


@dataclasses.dataclass(frozen=True)
class ServingPolicy:
  """One configuration: a ``--policies``-style entry and its budget (None for "full")."""

  entry: policy_entries.PolicyEntry
  budget: int | None
  window: int = 0  # --window: the observation window of every policy that has one

  @property
  def fields(self) -> dict:
    return self.entry.run_fields(self.window)

  @property
  def label(self) -> str:
    text = policy_entries.label(self.entry.name, self.fields)
    return text if self.budget is None else f"{text} @ {self.budget}"


def parse_policies(entries: Sequence[str], window: int = 0) -> list[ServingPolicy]:
  """``name[:budget][:field=value...]`` entries ("full", "snapkv:512", "sablock:512:window=8").

  Raises:
    ValueError: an empty list, a bad entry (a budget that is not an int, an
      unknown policy or field, a budget the policy cannot honour), or a repeat.
  """
  if not entries:
    raise ValueError("--serving_policies is empty")
  out, seen = [], set()
  for raw in entries:
    name, *parts = [p.strip() for p in raw.strip().split(":")]
    budget = None
    if parts and "=" not in parts[0]:
      try:
        budget = int(parts[0])
      except ValueError:
        raise ValueError(f"--serving_policies entry {raw!r}: expected a budget (an int) or "
                         f"field=value after {name!r}, got {parts[0]!r}") from None
      parts = parts[1:]
    try:
      entry = policy_entries.parse(":".join([name, *parts]))
      entry.make(window).validate(budget)
    except ValueError as e:
      raise ValueError(f"--serving_policies entry {raw!r}: {e}") from None
    config = ServingPolicy(entry, budget, window)
    key = (entry.name, tuple(sorted(config.fields.items())), budget)
    if key in seen:
      raise ValueError(f"--serving_policies repeats {config.label}")
    seen.add(key)
    out.append(config)
  return out


@dataclasses.dataclass(frozen=True)
class Work:
  """One request of the workload: its task sample, prompt ids and arrival time (s)."""

  sample: Sample
  ids: tuple[int, ...]
  arrival: float
  max_tokens: int


@dataclasses.dataclass(frozen=True)
class Workload:
  """The requests every configuration replays, and what drew them."""

  task: str
  prompt_tokens: int  # the length asked of each task prompt
  rate: float  # requests per second; inf: all at once
  seed: int
  requests: tuple[Work, ...]
  ignore_eos: bool = False  # every request generates max_tokens (vLLM's --ignore-eos)

  def describe(self) -> dict:
    """The workload's fields of a row (the rate as a string where it is inf: JSON)."""
    lengths = [len(w.ids) for w in self.requests]
    return {"task": self.task, "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
            "num_requests": len(self.requests),
            "rate": "inf" if math.isinf(self.rate) else self.rate, "seed": self.seed,
            "max_tokens": max(w.max_tokens for w in self.requests),
            "ignore_eos": self.ignore_eos}


def arrivals(count: int, rate: float, seed: int) -> np.ndarray:
  """Poisson arrival times: the first at 0, then exponential gaps of mean 1 / rate."""
  if math.isinf(rate):
    return np.zeros(count)
  gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, count)
  return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def make_workload(tokenizer, *, task: str, count: int, prompt_tokens: int, rate: float,
                  seed: int = 0, max_tokens: int = 0, ignore_eos: bool = False) -> Workload:
  """``count`` task prompts of about ``prompt_tokens`` tokens, at seeded depths and arrivals.

  A prompt is tokenized as the evaluation does (its context, then its
  question). ``max_tokens`` 0: each sample's own generation length; ``ignore_eos``:
  each request generates all of them (the tokenizer's stop ids left out).

  Raises:
    ValueError: an unknown task, a count or rate that is not positive, no tokenizer.
  """
  if task not in TASKS:
    raise ValueError(f"--serving_task must be one of {', '.join(TASKS)}, got {task!r}")
  if count < 1 or not rate > 0:
    raise ValueError(f"a workload needs requests (got {count}) at a positive rate "
                     f"(got {rate})")
  if tokenizer is None:
    raise ValueError("the serving benchmark's prompts are text: load a model with a tokenizer")
  depths = np.random.default_rng([seed, 0]).uniform(0.0, 1.0, count).round(3)
  work = []
  for index, (depth, arrival) in enumerate(zip(depths, arrivals(count, rate, seed))):
    sample = niah.make_sample(tokenizer, "niah", length=prompt_tokens, depth=float(depth),
                              haystack=TASKS[task], seed=seed, index=index)
    ids = tokenizer.encode(sample.context, add_bos=None) + tokenizer.encode(sample.question)
    work.append(Work(sample, tuple(ids), float(arrival), max_tokens or sample.max_new_tokens))
  return Workload(task, prompt_tokens, rate, seed, tuple(work), ignore_eos)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
  """What every configuration's engine shares, beside the pool (``kvjax.serve.Engine``)."""

  max_slots: int = 8
  prefill_chunk: int = 512
  page_size: int = 16
  steps_per_dispatch: int = 8
  backend: str = "auto"
  mesh: object = None  # a jax Mesh, or None: one device

  def engine_args(self, work: Sequence[Work]) -> dict:
    args = dict(max_slots=self.max_slots, max_prompt_tokens=max(len(w.ids) for w in work),
                max_tokens=max(w.max_tokens for w in work), prefill_chunk=self.prefill_chunk,
                page_size=self.page_size, steps_per_dispatch=self.steps_per_dispatch,
                backend=self.backend)
    return args if self.mesh is None else {**args, "mesh": self.mesh}


@dataclasses.dataclass(frozen=True)
class Pool:
  """The page pool every configuration gets: ``num_pages``, or ``kv_memory`` bytes."""

  num_pages: int | None = None
  kv_memory: str | int | None = None
  full_requests: float | None = None  # what num_pages was sized as (``full_cache_pool``)

  def describe(self) -> dict:
    return {"pool_full_requests": self.full_requests, "kv_memory": self.kv_memory}


def full_cache_pool(lm, workload: Workload, full_requests: float,
                    settings: EngineSettings) -> Pool:
  """The pool of ``full_requests`` full-cache requests of the longest kind.

  The longest kind is the full-cache engine's (its longest prompt, rounded as
  it rounds, plus its longest generation): ``Engine.pages_for`` of a probe
  engine whose pool is one such request at most (on one device: a request's
  pages do not depend on the mesh).
  """
  from kvjax.serve import Engine
  args = settings.engine_args(workload.requests)
  args.pop("mesh", None)
  cfg = lm.config
  tokens = args["max_prompt_tokens"] + max(args["prefill_chunk"], 64) + args["max_tokens"]
  bound = cfg.num_layers * cfg.num_kv_heads * -(-tokens // settings.page_size)
  probe = Engine(lm, policy="full", budget=None, num_pages=bound, **{**args, "max_slots": 1})
  need = probe.pages_for(probe.max_prompt, probe.max_tokens)
  del probe
  return Pool(num_pages=max(need, math.ceil(need * full_requests)), full_requests=full_requests)


@dataclasses.dataclass
class Trace:
  """What a replay saw: per request (by workload index) and per step, in seconds from 0."""

  submit: list[float | None]
  first: list[float | None]
  end: list[float | None]
  completions: list
  # One value per step: its end "t" and length "dt"; after it, the "pages" in use and the
  # requests "running" and "waiting"; the requests that "ended" in it, and "pages_in_step":
  # the pages in use after it plus those the ended ones held (``Engine.pages_for`` of their
  # prompt and tokens), the pages the step ran with.
  steps: dict


def replay(engine, work: Sequence[Work], *, label: str = "", progress: bool = True,
           ignore_eos: bool = False) -> Trace:
  """Submits each request (``work`` is in arrival order) at its arrival time, and steps
  the engine until every one has ended."""
  from tqdm import tqdm
  n = len(work)
  trace = Trace([None] * n, [None] * n, [None] * n, [None] * n,
                {k: [] for k in ("t", "dt", "pages", "pages_in_step", "running", "ended",
                                 "waiting")})
  index_of, next_up, start = {}, 0, time.perf_counter()
  clock = lambda: time.perf_counter() - start
  with tqdm(total=n, desc=f"serving {label}", unit="req", disable=not progress,
            file=sys.stderr) as bar:
    while next_up < n or engine.has_work:
      while next_up < n and work[next_up].arrival <= clock():
        w = work[next_up]
        index_of[engine.submit(list(w.ids), max_tokens=w.max_tokens,
                               ignore_eos=ignore_eos)] = next_up
        trace.submit[next_up] = clock()
        next_up += 1
      if not engine.has_work:
        time.sleep(max(0.0, work[next_up].arrival - clock()))
        continue
      before = clock()
      done = engine.step()
      now = clock()
      _record_step(trace, engine, index_of, done, before, now)
      bar.update(len(done))
  return trace


def _record_step(trace: Trace, engine, index_of: dict, done: list, before: float,
                 now: float) -> None:
  """Notes the step's first tokens, its completions and the engine's state after it."""
  for rid, i in index_of.items():
    if trace.first[i] is None and trace.end[i] is None and engine.tokens_of(rid):
      trace.first[i] = now
  for completion in done:
    i = index_of[completion.id]
    trace.end[i], trace.completions[i] = now, completion
    if trace.first[i] is None:
      trace.first[i] = now
  ended_pages = sum(engine.pages_for(c.prompt_tokens, len(c.token_ids)) for c in done)
  for key, value in (("t", now), ("dt", now - before), ("pages", engine.pages_in_use),
                     ("pages_in_step", engine.pages_in_use + ended_pages),
                     ("running", engine.running), ("ended", len(done)),
                     ("waiting", engine.waiting)):
    trace.steps[key].append(value)


def warm_up(engine, work: Sequence[Work]) -> float:
  """Runs the workload's longest and shortest prompt together (two tokens each); returns
  the seconds it took.

  Compiles the programs the replay runs (a one-shot prefill compiles a
  program per padded length; two requests take the paths of a shared pool),
  so that the replay times none of it.
  """
  start = time.perf_counter()
  by_length = sorted(work, key=lambda w: len(w.ids))
  for w in by_length[-1:] + by_length[:1] * (len(work) > 1):
    engine.submit(list(w.ids), max_tokens=min(2, w.max_tokens))
  while engine.has_work:
    engine.step()
  return time.perf_counter() - start


def _percentile(values: Sequence[float], q: float) -> float | None:
  return float(np.percentile(values, q)) if len(values) else None


def figures(trace: Trace, work: Sequence[Work]) -> dict:
  """The replay's figures: throughput, TTFT, TPOT, concurrency, pages and accuracy."""
  done = [c for c in trace.completions if c is not None]
  duration = max(e for e in trace.end if e is not None) if done else 0.0
  tokens = sum(len(c.token_ids) for c in done)
  ttft = [f - w.arrival for f, w in zip(trace.first, work) if f is not None]
  tpot = [(e - f) / (len(c.token_ids) - 1)
          for f, e, c in zip(trace.first, trace.end, trace.completions)
          if c is not None and len(c.token_ids) > 1]
  latency = [e - w.arrival for e, w in zip(trace.end, work) if e is not None]
  steps = trace.steps
  concurrency = [r + e for r, e in zip(steps["running"], steps["ended"])]
  scores = [s for s in _scores(trace, work) if s is not None]
  return {
      "completed": len(done), "duration_s": duration, "output_tokens": tokens,
      "output_tokens_per_s": tokens / duration if duration else None,
      "requests_per_s": len(done) / duration if duration else None,
      "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
      "tpot_p50_s": _percentile(tpot, 50), "tpot_p99_s": _percentile(tpot, 99),
      "latency_p50_s": _percentile(latency, 50), "latency_p99_s": _percentile(latency, 99),
      "peak_concurrency": max(concurrency, default=0),
      "mean_concurrency": (sum(c * dt for c, dt in zip(concurrency, steps["dt"])) / duration
                           if duration else 0.0),
      "peak_pages": max(steps["pages_in_step"], default=0), "num_steps": len(steps["t"]),
      "accuracy": sum(ok for _, ok in scores) / len(scores) if scores else None,
      "mean_score": sum(s for s, _ in scores) / len(scores) if scores else None,
  }


def _scores(trace: Trace, work: Sequence[Work]) -> list[tuple[float, bool] | None]:
  """Each completion's (score, correct) under its task's metric; None where none came."""
  return [None if c is None else
          metrics_lib.score(w.sample.metric, c.text, w.sample.answers,
                            all_classes=w.sample.all_classes)
          for w, c in zip(work, trace.completions)]


def _requests(trace: Trace, work: Sequence[Work]) -> list[dict]:
  """Each request as it went: its times, tokens, completion and score."""
  out = []
  for i, (w, scored) in enumerate(zip(work, _scores(trace, work))):
    c = trace.completions[i]
    out.append({"id": w.sample.id, "prompt_tokens": len(w.ids), "max_tokens": w.max_tokens,
                "arrival_s": w.arrival, "submit_s": trace.submit[i], "first_s": trace.first[i],
                "end_s": trace.end[i], "tokens": None if c is None else len(c.token_ids),
                "finish_reason": None if c is None else c.finish_reason,
                "prediction": None if c is None else c.text, "answers": list(w.sample.answers),
                "score": None if scored is None else scored[0],
                "correct": None if scored is None else scored[1]})
  return out


def measure(lm, config: ServingPolicy, workload: Workload, pool: Pool,
            settings: EngineSettings, *, progress: bool = True) -> dict:
  """One configuration's row: its engine built, warmed up, and the workload replayed."""
  import jax

  from kvjax import backend as backend_lib
  from kvjax.serve import Engine
  work = workload.requests
  engine = Engine(lm, policy=config.entry.make(config.window), budget=config.budget,
                  num_pages=pool.num_pages, kv_memory=pool.kv_memory,
                  **settings.engine_args(work))
  warm_s = warm_up(engine, work)
  preempted = engine.stats["preemptions"]
  trace = replay(engine, work, label=config.label, progress=progress,
                 ignore_eos=workload.ignore_eos)
  device = jax.devices()[0]
  return {
      "policy": config.entry.name, "policy_fields": config.fields,
      "policy_settings": policy_entries.settings(engine.policy, config.fields),
      "budget": config.budget, "label": config.label, **workload.describe(),
      **pool.describe(), "num_pages": engine.num_pages, "max_slots": settings.max_slots,
      "page_size": settings.page_size, "prefill_chunk": engine.chunk,
      "steps_per_dispatch": settings.steps_per_dispatch,
      "backend": backend_lib.resolve(settings.backend), "device": device.platform,
      "device_kind": device.device_kind, "warmup_s": warm_s, **figures(trace, work),
      "preemptions": engine.stats["preemptions"] - preempted,
      "timeline": trace.steps, "requests": _requests(trace, work),
  }


def run(lm, configs: Sequence[ServingPolicy], workload: Workload, pool: Pool,
        settings: EngineSettings, out: str | pathlib.Path, *, model: str = "",
        progress: bool = True) -> list[dict]:
  """Measures every configuration; writes results.jsonl, summary.md and pages.png under ``out``.

  Rows go to results.partial.jsonl as they come; once all have run, it
  replaces results.jsonl and the report is written (an interrupted run leaves
  the previous run's files as they were, but for its summary.md and pages.png,
  removed first so that none disagrees with results.jsonl).
  """
  from kvjax.bench import serving_report
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  for name in serving_report.FILES:
    (out / name).unlink(missing_ok=True)
  rows = []
  with (out / PARTIAL).open("w") as f:
    for config in configs:
      try:
        row = {"model": model, **measure(lm, config, workload, pool, settings,
                                         progress=progress)}
      except ValueError as e:  # a policy or pool the engine refuses
        raise ValueError(f"{config.label}: {e}") from None
      f.write(json.dumps(row) + "\n")
      f.flush()
      rows.append(row)
  os.replace(out / PARTIAL, out / "results.jsonl")
  serving_report.write(rows, out)
  return rows
