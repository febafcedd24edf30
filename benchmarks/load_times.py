r"""``kvjax.load`` with and without the orbax weight cache: first and second load.

  python benchmarks/load_times.py --models=smollm2-135m-instruct,gemma3-270m

Per model, three loads, each in a fresh Python process (so none borrows
another's warm imports, page cache aside): without the weight cache
(``weight_cache=None``: the file converted every time), then twice with
``weight_cache=<a new folder>``: the first converts and saves, the second
restores. Each process times ``kvjax.load`` alone (imports excluded) and
checks the restored model's logits on one prompt against the converted
model's. Writes --report (markdown) and --out (the rows, JSON).
"""

import json
import pathlib
import platform
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "Registry names or paths.")
flags.DEFINE_string("out", "results/load_times.json", "Rows, JSON.")
flags.DEFINE_string("report", "docs/results/load_times.md", "Markdown report.")

FLAGS = flags.FLAGS

# One load in its own process: the seconds of kvjax.load, the cache folder's
# size, and the last position's logits of a fixed prompt (for the check).
_CHILD = r"""
import json, pathlib, sys, time
import numpy as np
import kvjax
name, cache = sys.argv[1], sys.argv[2] or None
start = time.perf_counter()
lm = kvjax.load(name, weight_cache=cache)
seconds = time.perf_counter() - start
ids = lm.tokenizer.encode("The capital of France is", add_bos=None)
logits = np.asarray(lm.forward([ids]))[0, -1]
size = sum(p.stat().st_size for p in pathlib.Path(cache).rglob("*") if p.is_file()) if cache else 0
print(json.dumps({"seconds": seconds, "cache_bytes": size, "logits": logits[:4096].tolist()}))
"""


def _load(name: str, cache: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CHILD, name, cache], check=True,
                       capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def measure(name: str) -> dict:
  """The three loads of one model."""
  with tempfile.TemporaryDirectory() as tmp:
    plain = _load(name, "")
    first = _load(name, tmp)
    second = _load(name, tmp)
  ref = np.asarray(plain["logits"])
  diff = max(float(np.abs(np.asarray(r["logits"]) - ref).max()) for r in (first, second))
  return {"model": name, "no_cache_s": plain["seconds"], "first_s": first["seconds"],
          "second_s": second["seconds"], "cache_bytes": second["cache_bytes"],
          "max_logit_diff": diff}


def report(rows) -> str:
  lines = [
      "# Loading a model with and without the orbax weight cache", "",
      "```", "python benchmarks/load_times.py --models=" + ",".join(r["model"] for r in rows),
      "```", "",
      f"cpu: {platform.machine()}, float32 weights. Seconds of `kvjax.load` alone, each load "
      "in a fresh Python process (imports excluded, the OS page cache warm from earlier "
      "loads). *no cache*: `weight_cache=None`, the file converted every time; *first*: "
      "`weight_cache=<empty folder>`, converted and saved; *second*: the same folder, "
      "restored. *max |Δ logit|*: the restored and first-load models' last-position logits "
      "(first 4096 of the vocabulary) against the converted model's, on one prompt.", "",
      "| model | no cache | first (convert + save) | second (restore) | speed-up | cache on disk "
      "| max \\|Δ logit\\| |",
      "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['no_cache_s']:.2f} s | {r['first_s']:.2f} s | "
                 f"{r['second_s']:.2f} s | {r['no_cache_s'] / r['second_s']:.1f}x | "
                 f"{r['cache_bytes'] / 2**20:.1f} MiB | {r['max_logit_diff']:.1e} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  rows = []
  for name in FLAGS.models:
    rows.append(measure(name))
    print(json.dumps(rows[-1]), flush=True)
  pathlib.Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(FLAGS.out).write_text(json.dumps(rows, indent=1) + "\n")
  pathlib.Path(FLAGS.report).write_text(report(rows))


if __name__ == "__main__":
  app.run(main)
