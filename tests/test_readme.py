"""The README's two commands exist, and CI runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def _readme_commands():
  text = (ROOT / "README.md").read_text()
  block = re.search(r"## Two commands.*?```bash\n(.*?)```", text, re.S).group(1)
  return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_readme_has_the_demo_and_test_commands():
  demo, test = _readme_commands()
  assert demo == "bash scripts/demo.sh"
  assert test == "bash scripts/test.sh"
  for command in (demo, test):
    assert (ROOT / command.split()[1]).is_file(), command


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  test_cmd = re.search(r'^TEST_CMD="(.*)"$', ci, re.M).group(1)
  assert test_cmd == _readme_commands()[1]
  assert "$TEST_CMD" in ci
