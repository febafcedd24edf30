"""The design's import directions, checked on every module's source, and imports that stay light.

  kernels          import nothing of kvjax but kvjax.kernels
  kvjax.paths      imports nothing of kvjax (the cache folder: a leaf)
  kvjax.backend_choices  imports nothing of kvjax ("auto"'s table; no cache folder)
  kvjax.backend    imports only the kernels, kvjax.paths and its table of choices
  kvjax.cache      imports only the kernels and the backend switch
  kvjax.sharding   never imports a model module (a model states its own rules)
  kvjax.policies   never import the models, generation, tasks or the training code
  the library      never imports the command-line tools, nor the process set-up,
                   nor the top-level package's re-exports (``import kvjax``)
  installed code   reads no repository file (no path climbing out of kvjax/)

Every import counts, the ones inside functions too: a lazy import is a
dependency all the same.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The command-line tools and the process set-up they run: outside the library.
TOOLS = ("kvjax.eval", "kvjax.bench", "kvjax.cli", "kvjax.main", "kvjax.runtime",
         "kvjax.retrieval_heads.main", "kvjax.retrieval_heads.__main__", "kvjax.serve.__main__")


def _module_name(path: pathlib.Path) -> str:
  """kvjax/x/y.py -> kvjax.x.y; kernels/x.py -> kvjax.kernels.x (how kernels/ installs)."""
  rel = path.relative_to(ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[0] == "kernels":
    parts = ["kvjax", *parts]
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
  files = [*(ROOT / "kvjax").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
  return {_module_name(f): f for f in files if "__pycache__" not in f.parts}


MODULES = _sources()


def _is_package(name: str) -> bool:
  return (name + ".__init__") in MODULES or any(m.startswith(name + ".") for m in MODULES)


def _imported(name: str, path: pathlib.Path) -> set[str]:
  """The kvjax modules that ``name``'s source imports, anywhere in it (functions too)."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the module's package, up level - 1
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(filter(None, [*anchor, base]))
      for alias in node.names:
        # `from kvjax import backend` imports a module; `from kvjax.cache import X` a name.
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in MODULES or _is_package(sub) else base)
  return {m for m in found if m == "kvjax" or m.startswith("kvjax.")}


IMPORTS = {name: _imported(name, path) for name, path in MODULES.items()}


def _under(module: str, prefixes) -> bool:
  return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(sources, allowed=None, forbidden=()):
  """{module: sorted kvjax imports breaking the rule} for the modules under ``sources``."""
  bad = {}
  for name, imports in IMPORTS.items():
    if not _under(name, sources):
      continue
    wrong = {m for m in imports
             if (allowed is not None and not _under(m, allowed)) or _under(m, forbidden)}
    if wrong:
      bad[name] = sorted(wrong)
  return bad


def test_the_scan_sees_imports_at_the_top_and_inside_functions():
  assert "kvjax.execution" in IMPORTS["kvjax.cache.attention"]
  assert "kvjax.kernels.quantized" in IMPORTS["kvjax.models.lm"]
  # lm.load imports the registry inside the function.
  assert "kvjax.models.registry" in IMPORTS["kvjax.models.lm"]
  assert "kvjax.kernels.compaction" in MODULES and "kvjax.kernels" in MODULES


def test_kernels_import_only_kernels():
  assert _violations(["kvjax.kernels"], allowed=["kvjax.kernels"]) == {}


def test_paths_is_a_leaf():
  assert _violations(["kvjax.paths"], allowed=[]) == {}
  # A measured-choices file is named by its caller, never looked up in the cache folder.
  assert _violations(["kvjax.backend_choices"], allowed=[]) == {}


def test_backend_imports_only_kernels_and_paths():
  allowed = ["kvjax.kernels", "kvjax.paths", "kvjax.backend_choices"]
  assert _violations(["kvjax.backend"], allowed=allowed) == {}


def test_cache_imports_only_kernels_and_backend():
  # The collectives are a leaf: a chunked prefill's per-head rows reduce locally.
  # The execution context names each op's implementation (the backend switch's).
  allowed = ["kvjax.cache", "kvjax.kernels", "kvjax.backend", "kvjax.paths",
             "kvjax.sharding.collectives", "kvjax.execution"]
  assert _violations(["kvjax.cache"], allowed=allowed) == {}


def test_policies_never_see_models_generation_or_tasks():
  forbidden = ["kvjax.models", "kvjax.generation", "kvjax.tasks"]
  assert _violations(["kvjax.policies"], forbidden=forbidden) == {}


def test_policies_never_import_the_training_code():
  # Duo reads gates (kvjax.policies.gates); training and writing them is
  # kvjax.retrieval_heads, with optax and the models behind it.
  assert _violations(["kvjax.policies"], forbidden=["kvjax.retrieval_heads"]) == {}


def test_sharding_knows_no_model_module():
  # The layout reads a model's rules off the model it is given (its module's class).
  assert _violations(["kvjax.sharding"], forbidden=["kvjax.models"]) == {}


def test_the_library_never_imports_the_tools():
  # The package's facade names kvjax.runtime (for type checkers); it runs nothing of it.
  library = [name for name in MODULES if not _under(name, TOOLS)]
  bad = {}
  for name in library:
    tools = [t for t in TOOLS if not (name == "kvjax" and t == "kvjax.runtime")]
    found = sorted(m for m in IMPORTS[name] if _under(m, tools))
    if found:
      bad[name] = found
  assert bad == {}


def test_the_library_never_imports_the_package_facade():
  # `import kvjax` or `from kvjax import generate` reach the re-exports of
  # kvjax/__init__.py (a name of another module): the command-line tools'
  # entry, not the library's. `from kvjax import backend` is a module (fine).
  bad = sorted(name for name, imports in IMPORTS.items()
               if "kvjax" in imports and name != "kvjax" and not _under(name, TOOLS))
  assert bad == []


def test_the_scan_tells_the_facade_from_a_module():
  facade = _imported("kvjax.x", _write_source("import kvjax\nfrom kvjax import load"))
  assert facade == {"kvjax"}
  module = _imported("kvjax.x", _write_source("from kvjax import backend, plots"))
  assert module == {"kvjax.backend", "kvjax.plots"}


def _write_source(text: str) -> pathlib.Path:
  import tempfile  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(tempfile.mkdtemp()) / "x.py"
  path.write_text(text + "\n")
  return path


def _climbs(path: pathlib.Path, rel: pathlib.Path | None = None) -> list[str]:
  """Paths in ``path``'s source (at ``rel`` in the checkout) that climb out of its top
  folder (kvjax/ or kernels/): ``.parents[k]``, or ``.parent`` k + 1 times, past the
  folders it sits in."""
  rel = path.relative_to(ROOT) if rel is None else rel
  inside = len(rel.parts) - 2  # the deepest parents[k] still in its top folder
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    k = None
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
        and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)):
      k = node.slice.value
    elif isinstance(node, ast.Attribute) and node.attr == "parent":
      chain, inner = 0, node
      while isinstance(inner, ast.Attribute) and inner.attr == "parent":
        chain, inner = chain + 1, inner.value
      k = chain - 1
    if isinstance(k, int) and k > inside:
      found.append(f"line {node.lineno}: parents[{k}]")
  return found


def test_installed_code_reads_no_repository_file():
  # What the wheel installs must not reach the checkout around it (configs/,
  # docs/): `parents[3]` of kvjax/bench/accelerator/x.py is the repository.
  bad = {name: _climbs(path) for name, path in MODULES.items() if _climbs(path)}
  assert bad == {}
  source = _write_source("import pathlib\nHERE = pathlib.Path(__file__).parent\n"
                         "UP = pathlib.Path(__file__).resolve().parents[1]\n"
                         "TOO = HERE.parent.parent")
  assert _climbs(source, pathlib.Path("kvjax/x.py")) == ["line 3: parents[1]",
                                                        "line 4: parents[1]"]


# Run by a fresh interpreter: the kvjax modules one import loads.
_LOADED = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m == "kvjax" or m.startswith("kvjax."))))
"""

HEAVY = ("kvjax.models", "kvjax.policies", "kvjax.generation", "kvjax.tasks")


def _loaded_by(module: str) -> list[str]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", _LOADED, module], capture_output=True, text=True,
                       check=True, cwd=ROOT, env=env, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("module, heavy", [
    ("kvjax.cache", HEAVY),
    ("kvjax.kernels", HEAVY + ("kvjax.cache", "kvjax.backend")),
    ("kvjax.policies", ("kvjax.models", "kvjax.generation", "kvjax.tasks")),
    ("kvjax", HEAVY + ("kvjax.cache", "kvjax.kernels")),
])
def test_an_import_loads_only_what_it_needs(module, heavy):
  loaded = _loaded_by(module)
  assert module in loaded
  assert [m for m in loaded if _under(m, heavy)] == []
