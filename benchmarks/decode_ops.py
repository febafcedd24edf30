r"""Operations per layer of generate's decode program, lowered for a GPU or TPU on any machine.

  python benchmarks/decode_ops.py                      # Llama-3.2-1B, snapkv at 1024, pallas
  python benchmarks/decode_ops.py --backend=xla --platform=tpu --top=20

A decode step's cost on an accelerator is as much its launches as its bytes: a
few ops per layer is what lets it run near the floor. This lowers the decode
program generate builds (weights abstract: shapes only, nothing runs) for the
chosen platform, counts the StableHLO operations of every function in the
module, less constant, broadcast_in_dim, reshape, convert and returns (they
cost no launch of their own), and divides by the layers. The layers are
unrolled, as GPUs and TPUs run them by default.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import pathlib
import re

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax import execution
from kvjax.generation import compile as compile_lib
from kvjax.models.lm import LanguageModel
from kvjax.models.gemma3 import module_class  # any config: Llama or Gemma 3

flags.DEFINE_string("config", "llama3_2_1b", "A model config in configs/ (get_config()).")
flags.DEFINE_string("policy", "snapkv", "The policy (kvjax.policies.names()).")
flags.DEFINE_integer("budget", 1024, "KV entries per (layer, KV head); 0 for 'full'.")
flags.DEFINE_integer("prompt_tokens", 4095, "The prompt's length.")
flags.DEFINE_enum("backend", "pallas", ["auto", "xla", "pallas"], "Kernel backend.")
flags.DEFINE_enum("platform", "cuda", ["cuda", "tpu"], "The platform to lower for.")
flags.DEFINE_integer("top", 12, "Op kinds to list.")
FLAGS = flags.FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
FREE = {"stablehlo.constant", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
        "stablehlo.convert", "func.return", "stablehlo.return"}
TARGET = {"cuda": "gpu", "tpu": "tpu"}  # jax's lowering platform -> kvjax's


def count_ops(text: str) -> collections.Counter:
  """Op kinds of a lowered module's text (every function's body), less the free ones."""
  ops = collections.Counter(m.group(1) for m in re.finditer(
      r"^\s*(?:%\S+(?:, %\S+)*\s*=\s*)?\"?([a-z_]+\.[a-z_0-9]+)\"?[ (<{]", text, re.M))
  return collections.Counter({k: v for k, v in ops.items() if k not in FREE})


def _abstract_model(name: str) -> LanguageModel:
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  abstract = nnx.eval_shape(lambda: module_class(config)(
      config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scan_layers=False))
  graphdef, params = nnx.split(abstract)
  return LanguageModel(config, graphdef, params, None, f"abstract:{name}")


class _StandIn:
  """A compiled program's stand-in: zeros of its output shapes (``out_info`` as a program's)."""

  def __init__(self, out_info):
    self.out_info = out_info

  def __call__(self, *args):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.out_info)


def lowered_decode(lm: LanguageModel, platform: str) -> str:
  """The decode program's text: generate runs with every program lowered, not compiled."""
  texts = {}

  def lower_instead(fn, args, statics, mesh=None, kinds=None):
    del mesh, kinds
    if fn.__name__ == "decode":
      ex = execution.create(statics["ex"].backend, platform=TARGET[platform])
      program = jax.jit(functools.partial(fn, **dict(statics, ex=ex)), donate_argnums=(1,))
      texts["decode"] = program.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return _StandIn(jax.eval_shape(functools.partial(fn, **statics), *args)), 0.0

  compiled, compile_lib.compiled = compile_lib.compiled, lower_instead
  try:
    prompt = np.random.default_rng(0).integers(10, lm.config.vocab_size, FLAGS.prompt_tokens)
    kvjax.generate(lm, [prompt.tolist()], policy=FLAGS.policy, budget=FLAGS.budget or None,
                   max_new_tokens=4, backend=FLAGS.backend)
  finally:
    compile_lib.compiled = compiled
  return texts["decode"]


def main(argv):
  del argv
  lm = _abstract_model(FLAGS.config)
  ops = count_ops(lowered_decode(lm, FLAGS.platform))
  layers = lm.config.num_layers
  print(f"{FLAGS.config}, {FLAGS.policy} at {FLAGS.budget}, backend {FLAGS.backend}, lowered "
        f"for {FLAGS.platform}: {sum(ops.values())} ops, "
        f"{sum(ops.values()) / layers:.1f} per layer ({layers} layers)")
  for kind, n in ops.most_common(FLAGS.top):
    print(f"  {n / layers:6.2f} per layer  {kind}")


if __name__ == "__main__":
  app.run(main)
