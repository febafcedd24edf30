"""DuoAttention gates (kvjax.retrieval_heads): the mixed attention, the training, the files.

The attention is checked against a float64 numpy reference; the training on
tiny models, one of them built by hand with a single retrieval head, which
the gates must find; the orbax files round trip and fail in one clear line.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import testing
from kvjax.models import lm as lm_lib
from kvjax.models.gemma3 import reference_attend
from kvjax.retrieval_heads import data as data_lib
from kvjax.retrieval_heads import gates_io
from kvjax.retrieval_heads import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=256, tie_embeddings=True)


# ------------------------------------------------------------------ mixed attention

def _attention64(q, k, v, allowed):
  """float64 attention of q [B, T, N, H] over k, v [B, T, K, H] where allowed [T, T]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  group = n // k.shape[2]
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    for ni in range(n):
      kv = ni // group
      for i in range(t):
        keys = np.flatnonzero(allowed[i])
        s = k[bi, keys, kv] @ q[bi, i, ni] / np.sqrt(h)
        p = np.exp(s - s.max())
        out[bi, i, ni] = (p / p.sum()) @ v[bi, keys, kv]
  return out


def _mask64(t, n_sink, recent):
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  return (j <= i) & ((j < n_sink) | (i - j < recent))


def test_streaming_mask_by_hand():
  # Query 5 with 2 sinks and 2 recent keys sees 0, 1 (sinks), 4, 5 (itself and one before).
  mask = np.asarray(train.streaming_mask(7, n_sink=2, recent=2))
  np.testing.assert_array_equal(np.flatnonzero(mask[5]), [0, 1, 4, 5])
  np.testing.assert_array_equal(np.flatnonzero(mask[1]), [0, 1])
  np.testing.assert_array_equal(mask, _mask64(7, 2, 2))


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  b, t, n, kh, h = 2, 24, 4, 2, 8
  return (rng.standard_normal((b, t, n, h)).astype(np.float32) * 2,
          rng.standard_normal((b, t, kh, h)).astype(np.float32) * 2,
          rng.standard_normal((b, t, kh, h)).astype(np.float32))


def test_gate_one_is_full_causal_attention(qkv):
  q, k, v = qkv
  out = train.mixed_attention(q, k, v, jnp.ones(2), n_sink=2, recent=5)
  t = q.shape[1]
  testing.assert_close(out, _attention64(q, k, v, np.tril(np.ones((t, t), bool))))


def test_gate_zero_is_sink_and_recent_attention(qkv):
  q, k, v = qkv
  out = train.mixed_attention(q, k, v, jnp.zeros(2), n_sink=2, recent=5)
  testing.assert_close(out, _attention64(q, k, v, _mask64(q.shape[1], 2, 5)))


def test_each_kv_head_mixes_its_own_query_group(qkv):
  q, k, v = qkv
  gates = np.array([0.3, 0.8], np.float32)
  out = train.mixed_attention(q, k, v, jnp.asarray(gates), n_sink=2, recent=5)
  t = q.shape[1]
  full = _attention64(q, k, v, np.tril(np.ones((t, t), bool)))
  stream = _attention64(q, k, v, _mask64(t, 2, 5))
  g = np.repeat(gates.astype(np.float64), 2)[None, None, :, None]  # heads 0, 1 -> KV 0
  testing.assert_close(out, g * full + (1 - g) * stream)


def test_mixed_attention_checks_shapes(qkv):
  q, k, v = qkv
  with pytest.raises(ValueError, match=r"gates_layer must be \[K\]=\(2,\), got shape \(3,\)"):
    train.mixed_attention(q, k, v, jnp.ones(3), n_sink=2, recent=5)


# ------------------------------------------------------------------ training

def test_the_jitted_adam_loop_lowers_the_loss():
  lm = kvjax.init_random(TINY, seed=0)
  gates, losses = train.train_gates(lm, steps=6, length=64, recent=16, learning_rate=0.05,
                                    progress=False)
  assert gates.shape == (2, 2) and gates.dtype == np.float32
  assert np.all((gates >= 0) & (gates <= 1)) and np.all(gates < 1)
  assert len(losses) == 6
  assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "steps must be >= 1, got 0"),
    (dict(steps=2.5), "steps must be an integer, got 2.5"),
    (dict(learning_rate=0.0), "learning_rate must be > 0 and finite, got 0.0"),
    (dict(l1=-1.0), "l1 must be >= 0 and finite, got -1.0"),
    (dict(length=40, recent=32), "length 40 is too short for n_sink=4 \\+ recent=32"),
    (dict(length=300, recent=16), "length 300 exceeds the model's context of 256"),
])
def test_bad_settings_name_the_value(kwargs, message):
  lm = kvjax.init_random(TINY, seed=0)
  with pytest.raises(ValueError, match=message):
    train.train_gates(lm, **{"length": 64, "recent": 16, **kwargs}, progress=False)


def test_token_id_passkeys_repeat_the_key_at_the_end():
  tokens, answer = data_lib.token_batch(np.random.default_rng(3), length=64, batch_size=2,
                                        vocab_size=97, key_tokens=8)
  assert tokens.shape == (2, 64) and tokens.dtype == np.int32
  np.testing.assert_array_equal(answer, [8, 8])
  for row in tokens:
    assert row[-9] == 0
    key = row[-8:]
    assert any(np.array_equal(row[i:i + 8], key) for i in range(1, 32))


# A model built by hand: vocabulary 0 = BOS, 1 = the needle, 2.. filler. Every
# head but one attends to the BOS sink (kept by streaming attention); the
# planted one, layer 0's KV head 0, attends to the needle wherever it is.
PLANTED = kvjax.LlamaConfig(
    vocab_size=16, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=16, max_position_embeddings=256, tie_embeddings=False,
    attention_bias=True, rope_theta=1e6)
BOS, NEEDLE, SHARP = 0, 1, 6.0  # a flag key scores ~SHARP^2 * 4 / sqrt(H) = 50 above the rest


def _planted_model():
  c = PLANTED
  h, kh, g = c.head_dim, c.num_kv_heads, c.num_heads // c.num_kv_heads
  rng = np.random.default_rng(0)
  w = {k: np.array(v) for k, v in
       lm_lib.canonical_weights(kvjax.init_random(c, seed=0)).items()}
  embed = np.zeros((c.vocab_size, c.hidden_size), np.float32)
  embed[BOS, 0] = embed[NEEDLE, 1] = 8.0  # dims 0 and 1 flag BOS and the needle
  embed[:, 2:] = rng.standard_normal((c.vocab_size, c.hidden_size - 2)) * 0.3
  embed[2:, 2:] *= 1 / 0.3
  w["embed"] = embed
  # The lowest RoPE frequency's pair (h/2 - 1, h - 1) turns < 0.01 rad over 256
  # positions at theta 1e6: a constant query there scores keys by content.
  dim = h // 2 - 1
  for name in ("layers/wq", "layers/wk", "layers/bq", "layers/bk", "layers/bv"):
    w[name] = np.zeros_like(w[name])
  for layer in range(c.num_layers):
    for kv in range(kh):
      flag = NEEDLE if (layer, kv) == (0, 0) else BOS
      w["layers/wk"][layer, flag, kv * h + dim] = SHARP
      for head in range(kv * g, kv * g + g):
        w["layers/bq"][layer, head * h + dim] = SHARP
  w["layers/wv"] = (rng.standard_normal(w["layers/wv"].shape) * 0.25).astype(np.float32)
  # Nothing writes to the flag dimensions, and what layer 0 adds is small
  # beside them, so that layer 1 still finds BOS as sharply.
  for name in ("layers/wo", "layers/w_down"):
    w[name] = (rng.standard_normal(w[name].shape) * 0.2).astype(np.float32)
    w[name][..., :2] = 0.0
  graphdef, params = lm_lib.build_params(c, w)
  return lm_lib.LanguageModel(c, graphdef, params, None, "planted")


def _needle_data(length, batch_size, answer, recent):
  def batch(rng):
    tokens = rng.integers(2, PLANTED.vocab_size, size=(batch_size, length)).astype(np.int32)
    tokens[:, 0] = BOS
    for row in tokens:  # far from the answer, outside the sinks and the recent window
      row[int(rng.integers(8, length - recent - answer - 8))] = NEEDLE
    return tokens, np.full((batch_size,), answer, np.int32)
  return batch


def test_the_planted_retrieval_head_keeps_the_highest_gate():
  lm = _planted_model()
  n_sink, recent, length = 4, 16, 96
  data = _needle_data(length, 2, 4, recent)
  # The construction does what it says: streaming attention on the planted
  # head moves the answer's hidden states, on any other head next to nothing.
  tokens, answer = data(np.random.default_rng(1))
  tokens, answer = jnp.asarray(tokens), jnp.asarray(answer)
  full = train._hidden(lm.graphdef, lm.params, tokens, reference_attend(lm.config), None)
  mse = lambda gates: float(train.gate_loss(jnp.asarray(gates, jnp.float32), full, lm.graphdef,
                                            lm.params, tokens, answer, n_sink=n_sink,
                                            recent=recent, l1=0.0)[1])
  planted_off = np.ones((2, 2))
  planted_off[0, 0] = 0
  others_off = 1 - planted_off
  assert mse(planted_off) > 1e-2
  assert mse(others_off) < 1e-3 * mse(planted_off)

  gates, losses = train.train_gates(lm, steps=40, learning_rate=0.05, n_sink=n_sink,
                                    recent=recent, length=length, l1=0.1, data=data,
                                    progress=False)
  assert np.unravel_index(np.argmax(gates), gates.shape) == (0, 0), gates
  others = np.delete(gates.ravel(), 0)
  assert gates[0, 0] > 0.8, gates
  assert others.max() < 0.1, gates
  assert losses[-1] < losses[0]


# ------------------------------------------------------------------ files

def _save(path, model="tiny"):
  gates = np.array([[0.9, 0.1], [0.25, 0.5]], np.float32)
  gates_io.save_gates(path, gates, model=model, n_sink=4, recent=16, steps=3,
                      losses=[0.3, 0.2, 0.1], settings={"length": 64})
  return gates


def test_gates_round_trip_with_orbax(tmp_path):
  gates = _save(tmp_path / "g")
  loaded, metadata = gates_io.load_gates(tmp_path / "g", model="tiny")
  assert loaded.dtype == np.float32
  np.testing.assert_array_equal(loaded, gates)
  assert metadata["model"] == "tiny" and metadata["num_layers"] == 2
  assert metadata["num_kv_heads"] == 2
  assert (metadata["n_sink"], metadata["recent"], metadata["steps"]) == (4, 16, 3)
  np.testing.assert_allclose(metadata["losses"], [0.3, 0.2, 0.1])
  assert metadata["settings"] == {"length": 64}
  # A second save to the same folder replaces the first.
  gates_io.save_gates(tmp_path / "g", gates[::-1], model="tiny", n_sink=4, recent=16, steps=3,
                      losses=[0.1])
  np.testing.assert_array_equal(gates_io.load_gates(tmp_path / "g")[0], gates[::-1])


def test_gates_of_another_model_are_refused(tmp_path):
  _save(tmp_path / "g", model="tiny")
  with pytest.raises(ValueError, match="holds gates trained for 'tiny', not 'smollm2"):
    gates_io.load_gates(tmp_path / "g", model="smollm2-135m-instruct")


def test_missing_and_truncated_checkpoints_are_value_errors(tmp_path):
  with pytest.raises(ValueError, match="no gates at .*missing: the folder does not exist"):
    gates_io.load_gates(tmp_path / "missing")
  _save(tmp_path / "g")
  for f in (tmp_path / "g" / "gates").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[:10])  # a copy cut short
  with pytest.raises(ValueError, match="not a complete gates checkpoint"):
    gates_io.load_gates(tmp_path / "g")
  _save(tmp_path / "h")
  (tmp_path / "h" / "metadata" / "metadata").unlink()
  with pytest.raises(ValueError, match="not a complete gates checkpoint"):
    gates_io.load_gates(tmp_path / "h")


def test_bad_gates_are_not_saved(tmp_path):
  with pytest.raises(ValueError, match=r"gates must be \[L, K\], got shape \(3,\)"):
    gates_io.save_gates(tmp_path / "g", np.ones(3), model="x", n_sink=4, recent=8, steps=1,
                        losses=[])
  with pytest.raises(ValueError, match=r"gates must be in \[0, 1\], got \[0.0, 2.0\]"):
    gates_io.save_gates(tmp_path / "g", np.array([[0.0, 2.0]]), model="x", n_sink=4,
                        recent=8, steps=1, losses=[])


def test_the_shipped_smollm2_gates_load():
  path = gates_io.shipped_gates_path("smollm2-135m-instruct")
  assert path.is_relative_to(ROOT / "kvjax" / "retrieval_heads" / "gates")
  gates, metadata = gates_io.load_gates(path, model="smollm2-135m-instruct")
  assert gates.shape == (30, 3) and gates.dtype == np.float32
  assert np.all((gates >= 0) & (gates <= 1))
  assert metadata["steps"] == len(metadata["losses"])
  assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 64 * 1024


def test_unknown_shipped_gates_list_what_is_shipped():
  with pytest.raises(ValueError, match=r"no retrieval-head gates for 'nope'.*"
                                       r"smollm2-135m-instruct"):
    gates_io.shipped_gates_path("nope")


# ------------------------------------------------------------------ command line

def _tiny_checkpoint(folder: pathlib.Path) -> pathlib.Path:
  """A Hugging Face folder of a random TINY model, without a tokenizer."""
  import safetensors.numpy as safetensors_numpy
  c = TINY
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
      intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)))
  rng = np.random.default_rng(0)
  d, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
      c.intermediate_size
  shapes = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)})
  tensors = {n: (rng.standard_normal(s) * (1.0 if len(s) == 1 else 0.3)).astype(np.float32)
             for n, s in shapes.items()}
  safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
  return folder


def _cli(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "kvjax.retrieval_heads", *args],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_cli_trains_saves_and_reports(tmp_path):
  model = _tiny_checkpoint(tmp_path / "tiny")
  out = tmp_path / "out"
  res = _cli(f"--model={model}", "--steps=3", "--length=64", "--recent=16", f"--out={out}",
             "--noprogress")
  assert res.returncode == 0, res.stderr
  assert "| layer | kv 0 | kv 1 |" in res.stdout and "wall time" in res.stdout
  rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(set(r) == {"step", "loss", "mse", "seconds"} for r in rows)
  assert (out / "loss_curve.png").stat().st_size > 0
  gates, metadata = gates_io.load_gates(out / "gates", model=str(model))
  assert gates.shape == (2, 2)
  assert metadata["settings"]["length"] == 64
  np.testing.assert_allclose(metadata["losses"], [r["loss"] for r in rows])


def test_the_cli_refuses_a_bad_flag_in_one_line(tmp_path):
  res = _cli("--steps=0", f"--out={tmp_path}")
  assert res.returncode == 2
  assert res.stderr.strip() == "error: steps must be >= 1, got 0"


@pytest.mark.parametrize("bad", [np.nan, 7.5, -0.5])
def test_gates_written_past_the_check_are_refused_at_load(tmp_path, bad):
  """A folder of gates save_gates would refuse (NaN, 7.5), written by orbax directly."""
  from kvjax.cache import checkpoint  # pylint: disable=import-outside-toplevel
  _save(tmp_path / "good")
  gates, metadata = gates_io.load_gates(tmp_path / "good")
  gates[1, 0] = bad
  ocp, writer = checkpoint.checkpointer()
  with writer:
    writer.save(tmp_path / "g", args=ocp.args.Composite(
        gates=ocp.args.StandardSave({"gates": gates}), metadata=ocp.args.JsonSave(metadata)))
  with pytest.raises(ValueError, match=r"g: gates must be finite and in \[0, 1\]"):
    gates_io.load_gates(tmp_path / "g")
