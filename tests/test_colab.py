"""Notebooks: valid JSON, outputs cleared, they import only the library and what it teaches,
and each runs top to bottom on CPU in its small setting (nbclient, the venv's ipykernel)."""

import ast
import json
import pathlib
import re
import sys
import time

import pytest

COLAB = pathlib.Path(__file__).parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
# Imports a notebook may use besides Python's standard library (IPython: the kernel's display).
ALLOWED_IMPORTS = {"kvjax", "jax", "flax", "matplotlib", "numpy", "IPython"}
BADGE = re.compile(r"https://colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/blob/main/"
                   r"colab/([\w.-]+\.ipynb)")


def _load(path: pathlib.Path) -> dict:
  return json.loads(path.read_text())


def test_the_four_notebooks_exist():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "compare_policies.ipynb",
                                         "custom_policy.ipynb", "flax_integration.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_compile(path):
  nb = _load(path)
  code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
  assert code, "a notebook without code"
  for source in code:
    python = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith("!"))
    tree = ast.parse(python)
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        for name in names:
          top = name.split(".")[0]
          assert top in ALLOWED_IMPORTS or top in sys.stdlib_module_names, name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_clean_with_its_own_badge(path):
  """No outputs or execution counts in the repository; the badge opens this notebook."""
  nb = _load(path)
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
  first = "".join(nb["cells"][0]["source"])
  assert "colab-badge.svg" in first
  assert BADGE.search(first) and BADGE.search(first).group(1) == path.name


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=() if p.name == "quickstart.ipynb" else pytest.mark.slow)
    for p in NOTEBOOKS], ids=lambda p: p.name)  # the quickstart in the default suite
def test_notebook_runs_on_cpu(path, tmp_path, monkeypatch):
  """Every cell runs without an error, in a kernel of this test's own Python (the venv's).

  A CPU runtime selects each notebook's small setting; outputs land in tmp_path.
  """
  import nbclient
  import nbformat

  nb = nbformat.reads(path.read_text(), as_version=4)
  # The kernel must be this interpreter: the kernel spec's "python" resolves to sys.executable.
  nb.cells.insert(0, nbformat.v4.new_code_cell(
      f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.executable"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                   resources={"metadata": {"path": str(tmp_path)}})
  start = time.perf_counter()
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name}: a cell failed:\n{e}")
  print(f"{path.name} ran in {time.perf_counter() - start:.1f} s")


def test_flax_integration_doc_shows_the_notebooks_code():
  """Each python block of docs/flax_integration.md is the notebook's code, verbatim."""
  doc = (COLAB.parent / "docs" / "flax_integration.md").read_text()
  nb = _load(COLAB / "flax_integration.ipynb")
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
  assert len(blocks) >= 8
  for block in blocks:
    assert block.rstrip("\n") in code, block
