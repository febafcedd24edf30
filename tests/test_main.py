"""The demo CLI (python -m kvjax.main) end to end, and its errors."""

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
  for field in ("prefill", "decode", "kv cache", "tokens/s"):
    assert field in out.stdout


@pytest.mark.slow  # loads and compiles the unrolled model in a child process
def test_unrolled_layers_answer_the_same_question():
  out = _run("--context_tokens=600", "--max_new_tokens=12", "--noscan_layers")
  assert out.returncode == 0, out.stderr
  assert "(correct)" in out.stdout and "layers unrolled" in out.stdout


def test_bad_input_exits_2_with_one_line(tmp_path):
  for flags, message in [
      (["--prompt_file", str(tmp_path / "missing.txt")], "does not exist"),
      (["--policy=nope"], "unknown policy 'nope'"),
      (["--context_tokens=10"], "below the"),
  ]:
    out = _run(*flags)
    assert out.returncode == 2, (flags, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
