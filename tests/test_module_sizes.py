"""Every library module stays readable in one sitting: at most 600 lines, functions at most 80.

The limits keep a change local: a module past them is doing two jobs, a function
past them is several steps a name would explain. Every .py file under kvjax/
and kernels/ is checked, nested functions and methods included; nothing is
exempt (shorten or split instead).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[pathlib.Path]:
  files = [p for folder in ("kvjax", "kernels") for p in (ROOT / folder).rglob("*.py")
           if "__pycache__" not in p.parts]
  assert files, "no modules found"
  return sorted(files)


def _functions(tree: ast.AST, prefix: str = ""):
  """(qualified name, lines from its ``def`` to its last line) of every function."""
  for node in ast.iter_child_nodes(tree):
    name = prefix
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      name = f"{prefix}{node.name}."
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield name[:-1], node.end_lineno - node.lineno + 1
    yield from _functions(node, name)


def test_no_module_over_600_lines():
  too_long = []
  for path in _modules():
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if lines > MAX_MODULE_LINES:
      too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
  assert not too_long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(too_long)


def test_no_function_over_80_lines():
  too_long = []
  for path in _modules():
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for name, lines in _functions(tree):
      if lines > MAX_FUNCTION_LINES:
        too_long.append(f"{path.relative_to(ROOT)}: {name}: {lines} lines")
  assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


def test_the_checker_sees_nested_functions():
  # A nested function or a method must be measured on its own, not only inside its parent.
  tree = ast.parse("class C:\n  def m(self):\n    def inner():\n      pass\n")
  assert dict(_functions(tree)) == {"C.m": 3, "C.m.inner": 2}
