"""BUILD declares every module and test, with deps that match the sources.

Bazel cannot run here, so BUILD is parsed (evaluated with stub rule functions)
and compared with what tools/build_gen.py derives from the imports.
"""

from __future__ import annotations

import collections
import difflib
import importlib.util
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
REGEN = "run `python tools/build_gen.py --write` and commit BUILD"


class Req(str):
  """A requirement("name") label; a str so it sorts and prints like one."""


class Glob(list):
  """glob(...) result: patterns, not files (Bazel expands them)."""


def parse_build(text: str) -> dict[str, dict]:
  """Evaluates BUILD with stub rules; returns {target name: {"kind": rule, **attrs}}."""
  targets: dict[str, dict] = {}

  def rule(kind):
    def record(**kw):
      assert kw["name"] not in targets, f"BUILD defines {kw['name']!r} twice"
      targets[kw["name"]] = {"kind": kind, **kw}
    return record

  env = {
      "__builtins__": {},
      "load": lambda *a: None,
      "package": lambda **kw: None,
      "requirement": lambda name: Req(name),
      "glob": lambda include, exclude=(), allow_empty=False: Glob(include),
      **{k: rule(k) for k in ("py_library", "py_test", "py_binary", "genrule", "filegroup")},
  }
  exec(compile(text, "BUILD", "exec"), env)  # pylint: disable=exec-used
  return targets


def _build() -> dict[str, dict]:
  return parse_build((ROOT / "BUILD").read_text(encoding="utf-8"))


def _build_gen():
  spec = importlib.util.spec_from_file_location("build_gen", ROOT / "tools" / "build_gen.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules.setdefault("build_gen", mod)  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def _py_files(folder: str, pattern: str = "*.py") -> list[str]:
  return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob(pattern)
                if "__pycache__" not in p.parts)


def test_every_module_and_test_file_has_exactly_one_target():
  targets = _build()
  # Generated copies (kernels/x.py -> kvjax/kernels/x.py) stand for their source.
  copied = {}
  for t in targets.values():
    if t["kind"] == "genrule":
      (src,), (out,) = t["srcs"], t["outs"]
      assert (ROOT / src).is_file(), f"genrule {t['name']} copies missing {src}; {REGEN}"
      copied[out] = src
  owners = collections.defaultdict(list)
  for t in targets.values():
    if t["kind"].startswith("py_"):
      for src in t["srcs"]:
        real = copied.get(src, src)
        assert (ROOT / real).is_file(), f"{t['name']} points to missing {src}; {REGEN}"
        owners[real].append((t["name"], t["kind"]))
  expected = _py_files("kvjax") + _py_files("kernels") + _py_files("tests", "test_*.py")
  assert expected, "no sources found"
  for path in expected:
    assert len(owners[path]) == 1, f"{path} has targets {owners[path]} (want one); {REGEN}"
    if path.startswith("tests/"):
      assert owners[path][0][1] == "py_test", f"{path} must be a py_test; {REGEN}"


def test_kernel_sources_are_data_of_their_module():
  # The native kernels compile their C++ source at run time: it must travel with
  # the library (copied beside kvjax/kernels/native.py, as the .py files are).
  targets = _build()
  copied = {t["outs"][0]: t["srcs"][0] for t in targets.values() if t["kind"] == "genrule"}
  data = {copied.get(d, d) for t in targets.values() for d in t.get("data", [])
          if not d.startswith(":")}
  sources = _py_files("kernels", "*.cc")
  assert sources, "no C++ kernel sources found"
  for path in sources:
    assert path in data, f"{path} is no target's data; add it to DATA_FILES and {REGEN}"


def test_build_matches_generator():
  text, _, _ = _build_gen().generate(ROOT)
  current = (ROOT / "BUILD").read_text(encoding="utf-8")
  diff = "".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                      "BUILD (current)", "BUILD (generated)"))
  assert current == text, f"BUILD is stale: {REGEN}.\n{diff}"


def test_labels_resolve_and_graph_is_acyclic():
  targets = _build()
  graph = {}
  for name, t in targets.items():
    local = [d for d in t.get("deps", []) + t.get("data", [])
             if not isinstance(d, Req) and d.startswith(":")]
    for d in local:
      assert d[1:] in targets, f"{name} depends on undefined {d}; {REGEN}"
    graph[name] = [d[1:] for d in local]
  # Bazel rejects cycles; build_gen --write reports them too.
  done, active = set(), []

  def visit(n):
    assert n not in active, f"dependency cycle: {' -> '.join(active[active.index(n):] + [n])}"
    if n in done:
      return
    active.append(n)
    for d in graph[n]:
      visit(d)
    active.pop()
    done.add(n)

  for n in graph:
    visit(n)


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _names(specs) -> set[str]:
  return {_norm(re.match(r"[A-Za-z0-9._-]+", s).group(0)) for s in specs}


def test_third_party_deps_are_declared_in_pyproject():
  # An import that pyproject does not declare works here only by accident
  # (something else pulled it in) and fails for users of the wheel.
  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  runtime = _names(project["dependencies"])
  test = runtime | _names(project.get("optional-dependencies", {}).get("test", []))
  problems = []
  for name, t in sorted(_build().items()):
    reqs = {_norm(d) for d in t.get("deps", []) if isinstance(d, Req)}
    in_library = t["kind"] == "py_library" and not t["srcs"][0].startswith(("tests/", "tools/"))
    missing = reqs - (runtime if in_library else test)
    if missing:
      where = "[project].dependencies" if in_library else "dependencies or the test extra"
      problems.append(f"{name} ({t['srcs'][0]}) imports {sorted(missing)}, not in {where}")
  assert not problems, "\n".join(problems)
