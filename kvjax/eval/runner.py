"""Runs samples × policies × budgets through ``kvjax.generate_each`` into results.jsonl.

One JSON row per (sample, policy entry, budget): what was asked, what came
back, its score, the timings, the KV bytes allocated, and the policy's fields
set explicitly (``policy_fields``) and every setting it ran with
(``policy_settings``; ``kvjax.eval.policy_entries``). Each policy runs at its
own defaults unless ``window`` or its entry's fields say otherwise.

A sample's runs share its prompt's forward pass (one-shot prefill), so each
row's prefill_s counts that forward plus the row's own compression;
shared_prefill_s is the shared forward (the same in each of the sample's rows),
so prefill_s - shared_prefill_s is the row's own and a sum over rows adds the
shared forward once per sample. Rows already in the file under the same key
(``kvjax.eval.results``: the work a row records, the sample's content and the
policy's settings included) are reused, so an interrupted run resumes where it
stopped and a different run never borrows another's rows. Greedy decoding and seeded
prompts make a run deterministic for its seed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import sys
from typing import Sequence

from kvjax import policies
from kvjax.eval import metrics as metrics_lib
from kvjax.eval import policy_entries
from kvjax.eval import results as results_lib
from kvjax.tasks import dataset as dataset_lib
from kvjax.tasks import niah
from kvjax.tasks.sample import Sample

TASKS = niah.TASKS + ("dataset",)


class EvalError(RuntimeError):
  """A sample failed mid-run: the message names it and its runs; the cause is chained."""


class RunRows(list):
  """The run's rows in job order; ``reused`` came from ``path``, ``ran`` were run now."""

  def __init__(self, rows=(), *, reused: int = 0, ran: int = 0,
               path: pathlib.Path | None = None):
    super().__init__(rows)
    self.reused, self.ran, self.path = reused, ran, path


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """One evaluation run; the CLI's flags, one field each.

  ``policies`` holds ``--policies`` entries, ``name[:field=value...]``
  (``kvjax.eval.policy_entries``); ``window``, when nonzero, sets the
  observation window (H2O: recent window) of every policy that has one, under
  the fields an entry gives.
  """

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
  window: int = 0  # observation window (and H2O's recent window) of all; 0 = each policy's own
  prefill_chunk: int = 0  # 0 = one-shot prefill
  backend: str = "auto"
  max_new_tokens: int = 0  # 0 = the task's own (synthetic) or the row's / 32 (dataset)
  dataset: str | None = None
  metric: str = "auto"  # "auto": contains for synthetic tasks, qa_f1 for datasets
  page_size: int = 16
  packed: bool = False  # GGUF Q4_1 / Q8_0 matrices kept as their blocks (kvjax.load)
  mesh: str = ""  # "model:3": KV heads over devices (kvjax.sharding.make_mesh); "" one device

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
    for name, values, low in (("budgets", self.budgets, 1), ("lengths", self.lengths, 1)):
      if any(v < low for v in values):
        raise ValueError(f"--{name} must be positive, got {list(values)}")
    if any(not 0.0 <= d <= 1.0 for d in self.depths):
      raise ValueError(f"--depths must lie in [0, 1], got {list(self.depths)}")
    for name in ("num_samples", "window", "prefill_chunk", "max_new_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
    for name in ("budgets", "haystacks", "lengths", "depths"):
      values = getattr(self, name)
      repeated = sorted({str(v) for v in values if values.count(v) > 1})
      if repeated:  # the same work twice would be counted twice
        raise ValueError(f"--{name} repeats {', '.join(repeated)}")
    entries = self.entries()  # bad or repeated entries (the same work twice) raise here
    if any(e.name != "full" for e in entries) and not self.budgets:
      raise ValueError("--budgets is empty")

  def entries(self) -> tuple[policy_entries.PolicyEntry, ...]:
    """The ``policies`` entries parsed (ValueError for a bad or a repeated one)."""
    return policy_entries.parse_all(self.policies, self.window)


def make_samples(tokenizer, cfg: EvalConfig, max_tokens: int) -> list[Sample]:
  """The run's samples (synthetic prompts, or the dataset's rows)."""
  if cfg.task == "dataset":
    metric = "qa_f1" if cfg.metric == "auto" else cfg.metric
    samples = dataset_lib.dataset_samples(tokenizer, cfg.dataset, metric=metric,
                                          max_tokens=max_tokens, metrics=metrics_lib.METRICS)
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


def check_unique_ids(samples: Sequence[Sample]) -> None:
  """Raises ValueError when samples share an id (their rows would be counted as one).

  The dataset reader refuses a file's shared ids naming their lines; this
  guards every source of samples.
  """
  where = collections.defaultdict(list)
  for index, sample in enumerate(samples):
    where[sample.id].append(index + 1)
  repeated = [f"{k!r} (samples {', '.join(map(str, v))})" for k, v in where.items() if len(v) > 1]
  if repeated:
    raise ValueError(f"samples share ids: {'; '.join(repeated)}")


@dataclasses.dataclass(frozen=True)
class PolicyRun:
  """A policy entry as the run uses it.

  Attributes:
    name: the policy's name.
    fields: the fields set explicitly (``--window``'s and the entry's): the
      row's ``policy_fields``, part of its key and its label.
    policy: the policy, bound to the model's tokenizer.
    settings: every field of ``policy`` with its value (``policy_settings``).
  """

  name: str
  fields: dict
  policy: policies.Policy
  settings: dict

  @property
  def label(self) -> str:
    return policy_entries.label(self.name, self.fields)


def policy_runs(cfg: EvalConfig, tokenizer) -> list[PolicyRun]:
  """The run's policies, bound to ``tokenizer``, in ``--policies`` order."""
  out = []
  for entry in cfg.entries():
    fields = entry.run_fields(cfg.window)
    policy = entry.make(cfg.window).bind(tokenizer)
    out.append(PolicyRun(entry.name, fields, policy, policy_entries.settings(policy, fields)))
  return out


def _jobs(cfg: EvalConfig, runs: Sequence[PolicyRun], samples: Sequence[Sample]):
  """(policy run, budget, sample) to run, full cache once per sample."""
  for run_ in runs:
    for budget in ([None] if run_.name == "full" else cfg.budgets):
      for sample in samples:
        yield run_, budget, sample


def _check_runs(cfg: EvalConfig, runs: Sequence[PolicyRun]) -> None:
  """Every (policy, budget) of the run is one the policy can honour, before any work."""
  for run_ in runs:
    try:
      for budget in ([None] if run_.name == "full" else cfg.budgets):
        run_.policy.validate(budget)
      if cfg.prefill_chunk:
        run_.policy.check_chunk(cfg.prefill_chunk)
    except ValueError as e:
      if not run_.fields:
        raise
      raise ValueError(f"{run_.label}: {e}") from None


def run(cfg: EvalConfig, out: str | pathlib.Path, *, progress: bool = True,
        lm=None) -> RunRows:
  """Runs what results.jsonl under ``out`` lacks; returns all of the run's rows.

  A torn last line (a run killed mid-write) is reported on stderr and dropped.
  When there is work to run, the folder's summary.md and plots (an earlier
  run's) are removed first, so a run that fails leaves none that disagree
  with results.jsonl.

  Args:
    cfg: the run.
    out: output folder (created).
    progress: show the reused rows and a progress bar on stderr.
    lm: an already loaded model for ``cfg.model`` (loaded when None).

  Returns:
    The run's rows in job order, with ``reused`` / ``ran`` counts.

  Raises:
    ValueError: bad input found before any work (policies, budgets, dataset,
      shared sample ids); ``results.ResultsError`` for a damaged results file.
    EvalError: a sample failed while running (the cause chained).
  """
  import kvjax
  from tqdm import tqdm

  from kvjax.eval import report

  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "results.jsonl"
  if lm is None:
    lm = kvjax.load(cfg.model, packed=cfg.packed)
  runs = policy_runs(cfg, lm.tokenizer)
  _check_runs(cfg, runs)
  if cfg.mesh:  # a mesh that cannot split the model fails here, before any work
    kvjax.sharding.check_mesh(_mesh(cfg.mesh), lm.config)
  samples = make_samples(lm.require_tokenizer("the task's prompts"), cfg,
                         lm.config.max_position_embeddings - 64)
  check_unique_ids(samples)
  loaded = results_lib.read_rows(path)
  if loaded.torn_line is not None:
    results_lib.drop_torn_line(path, loaded)
  done = {results_lib.row_key(r): r for r in loaded.rows}
  dataset = str(pathlib.Path(cfg.dataset).resolve()) if cfg.dataset else None
  digests = {id(s): results_lib.sample_sha256(s.context, s.question, s.answers, s.all_classes)
             for s in samples}
  heads = [(_row_head(cfg, *job, dataset=dataset, digest=digests[id(job[-1])]), job)
           for job in _jobs(cfg, runs, samples)]
  reused = {i for i, (row, _) in enumerate(heads) if results_lib.row_key(row) in done}
  rows = [done[results_lib.row_key(row)] if i in reused else row
          for i, (row, _) in enumerate(heads)]
  # A sample's runs share one prompt forward (``kvjax.generate_each``).
  # Grouped by the sample object itself: dataset rows may share content.
  by_sample: dict[int, list] = {}
  for i, (row, job) in enumerate(heads):
    if i not in reused:
      by_sample.setdefault(id(job[-1]), []).append((row, job))
  todo = len(heads) - len(reused)
  if progress and reused:
    print(f"eval: {len(reused)} rows reused from {path}, {todo} to run", file=sys.stderr)
  if todo:
    report.remove_outputs(out)
  index_of = {id(s): i for i, s in enumerate(samples)}
  # The bar closes on an error too, so the error's line starts a line of its own.
  with tqdm(total=todo, desc="eval", unit="run", disable=not progress or not todo,
            file=sys.stderr) as bar, results_lib.Appender(path) as appender:
    for group in by_sample.values():
      sample = group[0][1][-1]
      bar.set_postfix_str(f"{sample.num_tokens} tok, {len(group)} runs", refresh=False)
      for row, result in zip((row for row, _ in group),
                             _run_sample(lm, cfg, group, sample, index_of[id(sample)])):
        row.update(result)
        appender.append(row)
        bar.update()
  return RunRows(rows, reused=len(reused), ran=todo, path=path)


def _run_sample(lm, cfg: EvalConfig, group, sample: Sample, index: int) -> list[dict]:
  """The result fields of each of a sample's runs; a failure is re-raised naming them."""
  runs = [(run_.policy, budget) for _, (run_, budget, _) in group]
  try:
    return list(_generate(lm, cfg, runs, sample))
  except Exception as e:  # any failure: the user needs to know which sample and runs
    names = ", ".join(run_.label if budget is None else f"{run_.label} at budget {budget}"
                      for _, (run_, budget, _) in group)
    raise EvalError(f"{describe_sample(sample, cfg, index)} under {names}: "
                    f"{type(e).__name__}: {e}") from e


def describe_sample(sample: Sample, cfg: EvalConfig, index: int) -> str:
  """Which sample: a dataset's row and id, or a synthetic task's length, depth and filler."""
  if cfg.task == "dataset":
    return (f"dataset {cfg.dataset} row {index + 1} (id {sample.id!r}, "
            f"{sample.num_tokens} prompt tokens)")
  return (f"sample {sample.id!r} ({sample.task}, {sample.target_tokens} tokens, "
          f"depth {sample.depth:g}, {sample.haystack} haystack)")


def _row_head(cfg, run_: PolicyRun, budget, sample: Sample, *, dataset: str | None,
              digest: str) -> dict:
  """The fields a row has before it runs: its key (results.KEY_FIELDS) and descriptions."""
  return {
      "model": cfg.model, "task": sample.task, "haystack": sample.haystack,
      "dataset": dataset, "sample_sha256": digest,
      "id": sample.id, "policy": run_.name, "policy_fields": run_.fields,
      "policy_settings": run_.settings, "budget": budget,
      "length": sample.target_tokens or length_bucket(sample.num_tokens),
      "prompt_tokens": sample.num_tokens, "depth": sample.depth, "query_aware": cfg.query_aware,
      "prefill_chunk": cfg.prefill_chunk, "packed": cfg.packed, "seed": cfg.seed,
      "max_new_tokens": cfg.max_new_tokens or sample.max_new_tokens, "metric": sample.metric,
  }


def _generate(lm, cfg: EvalConfig, runs, sample: Sample):
  """Yields each run's result fields for one sample."""
  import kvjax
  tok = lm.tokenizer
  results = kvjax.generate_each(
      lm, [tok.encode(sample.context, add_bos=None)], runs,
      questions=[tok.encode(sample.question)],
      query_aware=cfg.query_aware, max_new_tokens=cfg.max_new_tokens or sample.max_new_tokens,
      backend=cfg.backend, page_size=cfg.page_size, prefill_chunk=cfg.prefill_chunk,
      mesh=_mesh(cfg.mesh))
  for result in results:
    prediction = result.texts[0]
    score, correct = metrics_lib.score(sample.metric, prediction, sample.answers,
                                       all_classes=sample.all_classes)
    s = result.stats
    yield {"correct": correct, "score": score, "prediction": prediction,
           "answer": list(sample.answers), "prefill_s": s.prefill_s,
           "shared_prefill_s": s.shared_prefill_s, "decode_s": s.decode_s,
           "compile_s": s.compile_s, "kv_bytes": s.kv_bytes,
           "kv_bytes_per_device": s.kv_bytes_per_device, "mesh": cfg.mesh, "backend": s.backend}


@functools.cache  # one Mesh per shape for the whole run
def _mesh(shape: str):
  """The run's mesh; the eval generates one sample at a time, so its data axis is 1."""
  if not shape:
    return None
  from kvjax import sharding
  mesh = sharding.make_mesh(shape)
  if mesh.shape[sharding.DATA] != 1:
    raise ValueError(f"--mesh {shape}: the eval runs one sample at a time, so its data axis "
                     "must be 1 (split the KV heads: --mesh=model:N)")
  return mesh
