"""kernels/ installs as kvjax.kernels, never as a top-level `kernels` package.

A package named `kernels` exists on PyPI; shipping ours under that name would
clash in site-packages. The wheel is built from a copy of the checkout so the
build leaves nothing behind in it. Importing kvjax leaves Pallas' TPU and GPU
lowerings unloaded until a kernel asks for them. The installed wheel runs the
accelerator preset from a folder outside the checkout: it reads no repository
file.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".pytest_cache",
    ".hypothesis", "results", "*.whl")

# Printed by a fresh interpreter: where kvjax, kvjax.kernels and `kernels` come from.
PROBE = """
import importlib.util, json
import kvjax.kernels, kvjax
spec = importlib.util.find_spec("kernels")
print(json.dumps({"kvjax": kvjax.__file__, "kvjax.kernels": kvjax.kernels.__file__,
                  "kernels": spec and spec.origin}))
"""

def _run(cmd, **kw):
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
  assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
  return res.stdout


def _env(pythonpath: pathlib.Path | None) -> dict:
  """This process's environment for a CPU run, with ``pythonpath`` first on the path."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  if pythonpath is not None:
    # Prepended: it must win over the editable install in this venv.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath),
                                                      os.environ.get("PYTHONPATH")]))
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _probe(cwd: pathlib.Path, pythonpath: pathlib.Path | None) -> dict:
  """Runs PROBE in a fresh interpreter, from a folder outside the checkout."""
  out = _run([sys.executable, "-c", PROBE], cwd=cwd, env=_env(pythonpath))
  return json.loads(out.strip().splitlines()[-1])


def _inside(path, folder: pathlib.Path) -> bool:
  return path is not None and pathlib.Path(path).resolve().is_relative_to(folder.resolve())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  src = tmp_path_factory.mktemp("src") / "kvjax"
  shutil.copytree(ROOT, src, ignore=IGNORE)
  out = tmp_path_factory.mktemp("wheel")
  _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
        "-w", str(out)], cwd=src)
  (whl,) = out.glob("kvjax-*.whl")
  return whl


def test_wheel_ships_kernels_under_kvjax(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  assert "kvjax/kernels/__init__.py" in names
  assert "kvjax/kernels/paged_attention.py" in names
  assert not [n for n in names if n.startswith("kernels/")], "top-level kernels/ in wheel"
  (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
  if top_level:
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["kvjax"]


def test_wheel_ships_every_module(wheel):
  # A subpackage missing from pyproject's `packages` would silently drop out.
  names = set(zipfile.ZipFile(wheel).namelist())
  want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvjax").rglob("*.py")}
  want |= {"kvjax/kernels/" + p.relative_to(ROOT / "kernels").as_posix()
           for p in (ROOT / "kernels").rglob("*.py")}
  want |= {"kvjax/kernels/" + p.name  # C++ sources and headers
           for pattern in ("*.cc", "*.h") for p in (ROOT / "kernels").glob(pattern)}
  want |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvjax").rglob("*.txt")}  # documents
  want = {w for w in want if "__pycache__" not in w}
  assert not want - names, f"missing from the wheel: {sorted(want - names)}"


def _install(wheel: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """(site folder with the wheel installed in it, an empty working folder), both
  outside the checkout."""
  target = tmp_path / "site"
  _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target",
        str(target), str(wheel)])
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  return target, cwd


def test_installed_wheel_imports_kvjax_kernels(wheel, tmp_path):
  target, cwd = _install(wheel, tmp_path)
  assert not (target / "kernels").exists()
  found = _probe(cwd, target)
  assert _inside(found["kvjax.kernels"], target / "kvjax" / "kernels"), found
  assert _inside(found["kvjax"], target / "kvjax"), found
  # `import kernels` must not find this project (the wheel or the checkout).
  assert not _inside(found["kernels"], target), found
  assert not _inside(found["kernels"], ROOT), found


# Printed by a fresh interpreter: where the preset's code and its full-scale shapes come from.
SHAPES = """
import json
from kvjax.bench import accelerator
from kvjax.bench.accelerator import scales
print(json.dumps({"scales": scales.__file__, "model": scales.model_config("llama3_2_1b").name,
                  "equality": scales.model_config("smollm2_135m").num_layers}))
"""


# 72-102 s on the shared 2-core machine (every section at toy sizes; about 58 s of CPU).
@pytest.mark.slow
def test_installed_wheel_runs_the_accelerator_preset_outside_the_checkout(wheel, tmp_path):
  # Its model shapes ship in the package (no configs/ beside it); on a CPU the
  # small scale runs every section, none refused, at toy sizes.
  target, cwd = _install(wheel, tmp_path)
  found = json.loads(_run([sys.executable, "-c", SHAPES], cwd=cwd,
                          env=_env(target)).strip().splitlines()[-1])
  assert _inside(found["scales"], target / "kvjax"), found
  assert (found["model"], found["equality"]) == ("Llama-3.2-1B", 30), found
  out = cwd / "out"
  stdout = _run([sys.executable, "-m", "kvjax.bench", "--preset=accelerator", "--scale=small",
                 f"--out={out}"], cwd=cwd, env=_env(target))
  rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  assert [r for r in rows if r["status"] != "ok"] == []
  assert {r["section"] for r in rows} == {"kernel", "decode", "throughput", "prefill",
                                          "equality"}
  assert all(r["equal"] for r in rows if r["section"] == "equality"), rows
  choices = json.loads((out / "auto_choices.json").read_text())
  assert set(choices["ops"]) == {"paged_attention", "causal_attention"}, choices
  assert f"export KVJAX_AUTO_CHOICES={out / 'auto_choices.json'}" in stdout
  assert "`python -m kvjax.bench --preset=accelerator --scale=small`" in (
      out / "summary.md").read_text()


def test_source_tree_imports_kvjax_kernels(tmp_path):
  found = _probe(tmp_path, None)
  assert _inside(found["kvjax"], ROOT), f"kvjax is imported from elsewhere: {found['kvjax']}"
  assert _inside(found["kvjax.kernels"], ROOT / "kernels"), found
  assert not _inside(found["kernels"], ROOT), found


# Printed by a fresh interpreter: the Pallas lowerings loaded after importing kvjax
# and its tools, then after asking for each lowering's compiler parameters.
LOWERINGS = """
import json, sys
import kvjax, kvjax.bench.runner, kvjax.eval.runner
from kvjax.kernels import platform
names = ("jax.experimental.pallas.tpu", "jax.experimental.pallas.triton")
loaded = lambda: [n for n in names if n in sys.modules]
found = {"imported": loaded()}
params = {form: type(platform.compiler_params(form, 2)).__module__
          for form in (platform.TPU, platform.GPU)}
print(json.dumps({**found, "after_kernels": loaded(), "params": params}))
"""


def test_pallas_lowerings_load_when_a_kernel_needs_them(tmp_path):
  # On a CPU, the native and XLA backends never lower a Pallas kernel: the TPU
  # and Triton modules (~9 MiB resident) stay out of the process until one does.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  found = json.loads(_run([sys.executable, "-c", LOWERINGS], cwd=tmp_path,
                          env=env).strip().splitlines()[-1])
  assert found["imported"] == [], found
  assert found["after_kernels"] == ["jax.experimental.pallas.tpu",
                                    "jax.experimental.pallas.triton"], found
  assert "mosaic" in found["params"]["mosaic_tpu"], found
  assert "triton" in found["params"]["triton"], found
