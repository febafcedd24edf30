"""Notebooks: valid JSON, their Python cells compile, and they call only the library."""

import ast
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_compile(path):
  nb = json.loads(path.read_text())
  code = [("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "code"]
  assert code, "a notebook without code"
  for source in code:
    python = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith("!"))
    tree = ast.parse(python)
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        for name in names:
          assert name.split(".")[0] in {"kvjax", "jax", "matplotlib", "numpy"}, name
