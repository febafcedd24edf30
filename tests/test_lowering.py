"""Every program ``generate`` compiles lowers for GPU (cuda) and TPU, for every policy.

No chip here: each program generate asks for is traced again with an
execution built for the chip (``kvjax.execution.create(backend, platform=...)``:
kernels in their compiled form, "auto" resolved as it would be there) and
lowered with
``lowering_platforms``; generate itself gets a stand-in program that returns
zeros of the right shapes, so nothing runs and the weights can stay abstract
(shapes only: SmolLM2's and Llama-3.2-1B's real widths cost no memory).

The default suite lowers the one-shot prefill and the decode loop of every
policy under "auto" and "pallas" at SmolLM2's shape; the tests marked slow
add the chunked prefill, the question appended uncompressed, the recorded
prompt shared by several runs, and the Llama-3.2-1B shape. Gemma 3 270M's
shape, whose local layers are rings, lowers every program kind for four
policies in the default suite.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import backend as backend_lib
from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.generation import compile as compile_lib
from kvjax.kernels import platform as platform_lib
from kvjax.models.config import Gemma3Config
from kvjax.models.gemma3 import module_class
from kvjax.models.lm import LanguageModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
# jax's platform name for lowering -> kvjax's target platform, and the text a
# Pallas kernel leaves in the lowered program.
TARGETS = {"cuda": ("gpu", "triton"), "tpu": ("tpu", "tpu_custom_call")}
DELIMITERS = (5, 6, 7)
# A prompt length that is no power of two and no multiple of the padding.
PROMPT_TOKENS = 2047


def _config(name: str):
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# Gemma 3 270M's shape (its GGUF's metadata): 15 local layers of a 512-token
# window, a ring in the paged cache, and 3 global ones.
GEMMA3_270M = Gemma3Config(
    vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4, num_kv_heads=1,
    head_dim=256, intermediate_size=2048, rms_norm_eps=1e-6, rope_theta=1e6,
    rope_local_theta=1e4, max_position_embeddings=32768, sliding_window=512,
    name="gemma3-270m")


@functools.cache
def _abstract_model(config_name: str, scan_layers: bool) -> LanguageModel:
  """The model with weights as shapes only (jax.ShapeDtypeStruct leaves)."""
  config = GEMMA3_270M if config_name == "gemma3_270m" else _config(config_name)
  abstract = nnx.eval_shape(lambda: module_class(config)(
      config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scan_layers=scan_layers))
  graphdef, params = nnx.split(abstract)
  return LanguageModel(config, graphdef, params, None, f"abstract:{config_name}")


def _policy(name: str, config, folder: pathlib.Path):
  return testing.policy_for(name, config, folder, DELIMITERS)


class _StandIn:
  """A compiled program's stand-in: zeros of the program's output shapes."""

  def __init__(self, out_info):
    self.out_info = out_info

  def __call__(self, *args):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.out_info)


@pytest.fixture
def lowered(monkeypatch):
  """Makes generate lower each of its programs for cuda and tpu instead of compiling it.

  Yields the list of (program name, platform, lowered text) in the order lowered.
  """
  seen: list[tuple[str, str, str]] = []
  done: dict = {}

  def lower_instead(fn, args, statics, mesh=None):
    assert mesh is None
    key = (fn.__name__, tuple(sorted(statics.items(), key=lambda kv: kv[0])),
           jax.tree.structure(args),
           tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(args)))
    if key not in done:
      for lowering_platform, (target, _) in TARGETS.items():
        ex = execution.create(statics["ex"].backend, platform=target)
        program = functools.partial(fn, **dict(statics, ex=ex))
        text = jax.jit(program, donate_argnums=(1,)).trace(*args).lower(
            lowering_platforms=(lowering_platform,)).as_text()
        seen.append((fn.__name__, lowering_platform, text))
      done[key] = _StandIn(jax.eval_shape(functools.partial(fn, **statics), *args))
    return done[key], 0.0

  monkeypatch.setattr(compile_lib, "compiled", lower_instead)
  yield seen


def _prompt(vocab_size: int) -> list[int]:
  rng = np.random.default_rng(0)
  ids = rng.integers(len(DELIMITERS) + 5, vocab_size, PROMPT_TOKENS)
  ids[rng.random(PROMPT_TOKENS) < 0.08] = DELIMITERS[0]
  return ids.tolist()


def _budget(name: str) -> int | None:
  return None if name == "full" else 256


def _check(seen, programs: set[str], backend: str):
  """Each program lowered for both platforms; under "pallas" the kernels are in it."""
  for name in programs:
    got = {plat for prog, plat, _ in seen if prog == name}
    assert got == set(TARGETS), f"{name} lowered for {sorted(got)}"
  if backend == "pallas":
    for prog, plat, text in seen:
      if prog in ("decode", "prefill_chunk"):  # paged attention / compaction kernels
        marker = TARGETS[plat][1]
        assert marker in text, f"{prog} for {plat} holds no {marker} kernel"


@pytest.mark.parametrize("backend", ["auto", "pallas"])
@pytest.mark.parametrize("name", policies.names())
def test_prefill_and_decode_lower(lowered, name, backend, tmp_path):
  lm = _abstract_model("smollm2_135m", scan_layers=True)
  kvjax.generate(lm, [_prompt(lm.config.vocab_size)], policy=_policy(name, lm.config, tmp_path),
                 budget=_budget(name), max_new_tokens=4, backend=backend)
  _check(lowered, {"prefill", "decode"}, backend)


def _every_program(lowered, name, backend, config_name, scan_layers, tmp_path):
  """Lowers every program kind ``generate`` compiles for ``name`` on the model."""
  lm = _abstract_model(config_name, scan_layers)
  policy, budget = _policy(name, lm.config, tmp_path), _budget(name)
  prompt = _prompt(lm.config.vocab_size)
  kw = dict(max_new_tokens=4, backend=backend)
  kvjax.generate(lm, [prompt, prompt[:1500]], policy=policy, budget=budget,
                 questions=[[9, 10, 11]] * 2, query_aware=False, **kw)
  programs = {"prefill", "extend", "decode"}
  list(kvjax.generate_each(lm, [prompt], [(policy, budget), ("full", None)], **kw))
  programs |= {"record", "store"} | ({"score"} if policy.shares_scores else set())
  if policy.chunked_prefill:
    kvjax.generate(lm, [prompt], policy=policy, budget=budget, prefill_chunk=512, **kw)
    programs.add("prefill_chunk")
  _check(lowered, programs, backend)


@pytest.mark.slow
@pytest.mark.parametrize("config_name,scan_layers",
                         [("smollm2_135m", False), ("llama3_2_1b", False)])
@pytest.mark.parametrize("backend", ["auto", "pallas"])
@pytest.mark.parametrize("name", policies.names())
def test_every_program_lowers(lowered, name, backend, config_name, scan_layers, tmp_path):
  """Unrolled layers, as GPUs and TPUs run them by default; every program kind."""
  _every_program(lowered, name, backend, config_name, scan_layers, tmp_path)


@pytest.mark.parametrize("name", [
    "full", "paged_eviction",
    *(pytest.param(n, marks=pytest.mark.slow) for n in ("snapkv", "h2o", "duo"))])
def test_gemma3_rings_lower(lowered, name, tmp_path):
  """Gemma 3 270M's shape, its local layers rings: a 2047-token prompt wraps them in
  the prefill, the chunked prefill and the question; the decode loop writes over them."""
  _every_program(lowered, name, "auto", "gemma3_270m", False, tmp_path)


def test_tracing_reads_no_ambient_state(monkeypatch):
  """Each program traced inside ``backend.use`` and ``targeting`` naming something
  else lowers to the same text as traced outside them: what it runs is its
  explicit execution (Pallas kernels for a TPU here), nothing ambient."""
  ex = execution.create("pallas", platform="tpu")
  texts: dict[str, tuple[str, str]] = {}

  def lower(fn, args, statics):
    jax.clear_caches()  # a kernel's jit cache would hide a second, ambient-reading trace
    program = jax.jit(functools.partial(fn, **dict(statics, ex=ex)), donate_argnums=(1,))
    return program.trace(*args).lower(lowering_platforms=("tpu",)).as_text()

  def lower_twice(fn, args, statics, mesh=None):
    plain = lower(fn, args, statics)
    # Ambient settings unlike both the explicit execution and the defaults (XLA, CPU).
    with backend_lib.use("pallas"), platform_lib.targeting("gpu"):
      inside = lower(fn, args, statics)
    texts[fn.__name__] = (plain, inside)
    return _StandIn(jax.eval_shape(functools.partial(fn, **statics), *args)), 0.0

  monkeypatch.setattr(compile_lib, "compiled", lower_twice)
  lm = _abstract_model("smollm2_135m", scan_layers=True)
  prompt = _prompt(lm.config.vocab_size)[:700]
  kvjax.generate(lm, [prompt], policy="snapkv", budget=128, max_new_tokens=2)
  kvjax.generate(lm, [prompt], policy="paged_eviction", budget=128, max_new_tokens=2,
                 prefill_chunk=256)
  assert set(texts) == {"prefill", "prefill_chunk", "decode"}
  for name, (plain, inside) in texts.items():
    assert "tpu_custom_call" in plain, f"{name} holds no Pallas kernel for the TPU"
    assert plain == inside, f"{name} traced differently inside backend.use / targeting"


def test_targeting_and_use_build_the_execution_they_name():
  with backend_lib.use("pallas"), platform_lib.targeting("tpu"):
    assert execution.ambient() == execution.create("pallas", platform="tpu")
  assert execution.ambient() == execution.create("xla")
