"""The demo CLI (python -m kvjax.main) end to end, and its errors."""

import re
import subprocess
import sys

import pytest


def _run(*flags):
  return subprocess.run([sys.executable, "-m", "kvjax.main", *flags], capture_output=True,
                        text=True, timeout=600)


def test_answers_a_passkey_question():
  out = _run("--context_tokens=600", "--max_new_tokens=12")
  assert out.returncode == 0, out.stderr
  assert "(correct)" in out.stdout
  line = lambda pattern: re.search(f"^{pattern}$", out.stdout, re.M)  # one stats line
  prompt = line(r"prompt +(\d+) tokens")
  assert prompt and 597 <= int(prompt[1]) <= 600, out.stdout  # never over --context_tokens
  assert line(r"policy +full, budget None, backend (xla|pallas|native), layers "
              r"(scanned|unrolled)"), out.stdout
  # The full cache: the prompt padded to 640 (generate's pad_multiple, 64) + 12 new tokens,
  # SmolLM2-135M's L, K, H in float32 keys and values.
  mib = 656 * 30 * 3 * 64 * 4 * 2 / 2**20
  assert line(rf"kv cache +{mib:.1f} MiB allocated"), out.stdout
  assert line(r"prefill +[\d.]+ s \(\d+ tokens/s\)"), out.stdout
  decode = line(r"decode +(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s, [\d.]+ ms/step\)")
  assert decode and 1 <= int(decode[1]) <= 12, out.stdout  # a stop id may end it early


@pytest.mark.slow  # loads and compiles the unrolled model in a child process
def test_unrolled_layers_answer_the_same_question():
  out = _run("--context_tokens=600", "--max_new_tokens=12", "--noscan_layers")
  assert out.returncode == 0, out.stderr
  assert "(correct)" in out.stdout and "layers unrolled" in out.stdout


def test_bad_input_exits_2_with_one_line(tmp_path):
  for flags, message in [
      (["--prompt_file", str(tmp_path / "missing.txt")], "does not exist"),
      (["--policy=nope"], "unknown policy 'nope'"),
      (["--policy=adakv:inner"], "--policy 'adakv:inner': expected field=value"),
      (["--policy=snapkv:windw=8"], "has no field(s) ['windw']"),
      (["--context_tokens=10"], "below the"),
  ]:
    out = _run(*flags)
    assert out.returncode == 2, (flags, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
