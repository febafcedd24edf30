"""Runs samples × policies × budgets through ``kvjax.generate_each`` into results.jsonl.

One JSON row per (sample, policy, budget): what was asked, what came back,
its score, the timings and the KV bytes allocated. A sample's runs share its
prompt's forward pass (one-shot prefill), so each row's prefill_s counts that
forward plus the row's own compression. Rows already in the file
(same key) are skipped, so an interrupted run resumes where it stopped.
Greedy decoding and seeded prompts make a run deterministic for its seed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Sequence

from kvjax import policies
from kvjax.eval import metrics as metrics_lib
from kvjax.tasks import dataset as dataset_lib
from kvjax.tasks import niah
from kvjax.tasks.sample import Sample

TASKS = niah.TASKS + ("dataset",)
# Fields of a row that identify it (a resumed run skips rows with a known key).
KEY_FIELDS = ("model", "task", "id", "policy", "policy_fields", "budget", "query_aware",
              "prefill_chunk", "packed")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """One evaluation run; the CLI's flags, one field each."""

  model: str = "smollm2-135m-instruct"
  policies: tuple[str, ...] = ("full", "streaming_llm", "snapkv", "pyramidkv", "knorm",
                               "chunkkv", "paged_eviction", "sablock", "dynsplit_kv")
  budgets: tuple[int, ...] = (128,)
  task: str = "niah"
  haystacks: tuple[str, ...] = ("repeat", "natural")  # synthetic tasks' filler kinds
  lengths: tuple[int, ...] = (2048,)  # prompt tokens (synthetic tasks)
  depths: tuple[float, ...] = (0.1, 0.5, 0.9)  # needle depths (synthetic tasks)
  num_samples: int = 0  # per (length, depth, haystack), or dataset rows; 0 = 1 / all rows
  seed: int = 0
  query_aware: bool = True
  window: int = 16  # observation window (and H2O's recent window); 0 = each policy's default
  prefill_chunk: int = 0  # 0 = one-shot prefill
  backend: str = "auto"
  max_new_tokens: int = 0  # 0 = the task's own (synthetic) or the row's / 32 (dataset)
  dataset: str | None = None
  metric: str = "auto"  # "auto": contains for synthetic tasks, qa_f1 for datasets
  page_size: int = 16
  packed: bool = False  # GGUF Q4_1 / Q8_0 matrices kept as their blocks (kvjax.load)

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
    if (self.task == "dataset") != (self.dataset is not None):
      raise ValueError("--dataset goes with --task=dataset (and only with it)")
    if self.metric != "auto" and self.metric not in metrics_lib.METRICS:
      raise ValueError(f"--metric must be auto or one of {', '.join(metrics_lib.METRICS)}, "
                       f"got {self.metric!r}")
    if not self.policies:
      raise ValueError("--policies is empty")
    if any(p != "full" for p in self.policies) and not self.budgets:
      raise ValueError("--budgets is empty")
    for name, values, low in (("budgets", self.budgets, 1), ("lengths", self.lengths, 1)):
      if any(v < low for v in values):
        raise ValueError(f"--{name} must be positive, got {list(values)}")
    if any(not 0.0 <= d <= 1.0 for d in self.depths):
      raise ValueError(f"--depths must lie in [0, 1], got {list(self.depths)}")
    for name in ("num_samples", "window", "prefill_chunk", "max_new_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")


def make_samples(tokenizer, cfg: EvalConfig, max_tokens: int) -> list[Sample]:
  """The run's samples (synthetic prompts, or the dataset's rows)."""
  if cfg.task == "dataset":
    metric = "qa_f1" if cfg.metric == "auto" else cfg.metric
    samples = dataset_lib.dataset_samples(tokenizer, cfg.dataset, metric=metric,
                                          max_tokens=max_tokens)
    return samples[:cfg.num_samples or None]
  samples = []
  for length in cfg.lengths:
    if length > max_tokens:
      raise ValueError(f"--lengths {length} exceeds the model's context of {max_tokens} tokens")
    for haystack in cfg.haystacks:
      for depth in cfg.depths:
        for index in range(cfg.num_samples or 1):
          s = niah.make_sample(tokenizer, cfg.task, length=length, depth=depth,
                               haystack=haystack, seed=cfg.seed, index=index)
          if cfg.metric != "auto":
            s = dataclasses.replace(s, metric=cfg.metric)
          samples.append(s)
  return samples


def length_bucket(tokens: int) -> int:
  """Dataset prompts are grouped by the power of two their length rounds up to."""
  return 1 << max(0, tokens - 1).bit_length()


def row_key(row: dict) -> tuple:
  return tuple(json.dumps(row.get(k), sort_keys=True) for k in KEY_FIELDS)


def read_rows(path: pathlib.Path) -> list[dict]:
  """Rows of a results.jsonl (a torn last line from a killed run is dropped)."""
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def _jobs(cfg: EvalConfig, samples: Sequence[Sample]):
  """(policy, fields, budget, sample) to run, full cache once per sample."""
  for policy in cfg.policies:
    fields = policies.window_fields(policy, cfg.window)
    for budget in ([None] if policy == "full" else cfg.budgets):
      for sample in samples:
        yield policy, fields, budget, sample


def run(cfg: EvalConfig, out: str | pathlib.Path, *, progress: bool = True,
        lm=None) -> list[dict]:
  """Runs what results.jsonl under ``out`` lacks; returns all of the run's rows.

  Args:
    cfg: the run.
    out: output folder (created).
    progress: show a progress bar on stderr.
    lm: an already loaded model for ``cfg.model`` (loaded when None).
  """
  import kvjax
  from tqdm import tqdm

  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "results.jsonl"
  if lm is None:
    lm = kvjax.load(cfg.model, packed=cfg.packed)
  for name in cfg.policies:  # unknown names fail before any work
    kvjax.policies.get(name)
  samples = make_samples(lm.tokenizer, cfg, lm.config.max_position_embeddings - 64)
  done = {row_key(r): r for r in read_rows(path)}
  jobs, rows = [], []
  for policy, fields, budget, sample in _jobs(cfg, samples):
    row = _row_head(cfg, policy, fields, budget, sample)
    if row_key(row) in done:
      rows.append(done[row_key(row)])
    else:
      jobs.append((row, policy, fields, budget, sample))
  # A sample's runs share one prompt forward (``kvjax.generate_each``).
  # Grouped by the sample object itself: dataset rows may share (or lack) an id.
  by_sample: dict[int, list] = {}
  for job in jobs:
    by_sample.setdefault(id(job[-1]), []).append(job)
  bar = tqdm(total=len(jobs), desc="eval", unit="run", disable=not progress, file=sys.stderr)
  with path.open("a") as f:
    for group in by_sample.values():
      sample = group[0][-1]
      bar.set_postfix_str(f"{sample.num_tokens} tok, {len(group)} runs", refresh=False)
      runs = [(kvjax.policies.get(policy, **fields), budget)
              for _, policy, fields, budget, _ in group]
      for (row, *_), result in zip(group, _generate(lm, cfg, runs, sample)):
        row.update(result)
        f.write(json.dumps(row) + "\n")
        f.flush()
        rows.append(row)
        bar.update()
  bar.close()
  return rows


def _row_head(cfg, policy, fields, budget, sample: Sample) -> dict:
  return {
      "model": cfg.model, "task": sample.task, "haystack": sample.haystack, "id": sample.id,
      "policy": policy, "policy_fields": fields, "budget": budget,
      "length": sample.target_tokens or length_bucket(sample.num_tokens),
      "prompt_tokens": sample.num_tokens, "depth": sample.depth, "query_aware": cfg.query_aware,
      "prefill_chunk": cfg.prefill_chunk, "packed": cfg.packed, "seed": cfg.seed,
      "metric": sample.metric,
  }


def _generate(lm, cfg: EvalConfig, runs, sample: Sample):
  """Yields each run's result fields for one sample."""
  import kvjax
  tok = lm.tokenizer
  results = kvjax.generate_each(
      lm, [tok.encode(sample.context)], runs, questions=[tok.encode(sample.question)],
      query_aware=cfg.query_aware, max_new_tokens=cfg.max_new_tokens or sample.max_new_tokens,
      backend=cfg.backend, page_size=cfg.page_size, prefill_chunk=cfg.prefill_chunk)
  for result in results:
    prediction = result.texts[0]
    score, correct = metrics_lib.score(sample.metric, prediction, sample.answers,
                                       all_classes=sample.all_classes)
    s = result.stats
    yield {"correct": correct, "score": score, "prediction": prediction,
           "answer": list(sample.answers), "prefill_s": s.prefill_s, "decode_s": s.decode_s,
           "compile_s": s.compile_s, "kv_bytes": s.kv_bytes, "backend": s.backend}
