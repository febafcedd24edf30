"""The README's two commands exist, and CI runs the README's test command."""

import fnmatch
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


def _api_example() -> tuple[str, list[str]]:
  """The Python API section's code, and the lines its ``# ->`` comments say it prints."""
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## Python API"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  expected = [line.split("# -> ", 1)[1] for line in code.splitlines() if "# -> " in line]
  return code, expected


def test_readme_api_example_prints_what_it_says(capsys):
  code, expected = _api_example()
  assert len(expected) >= 10
  exec(compile(code, "README.md", "exec"), {})
  printed = capsys.readouterr().out.splitlines()
  assert len(printed) == len(expected), printed
  for got, want in zip(printed, expected):
    assert fnmatch.fnmatchcase(got, want), (got, want)
