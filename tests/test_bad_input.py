"""Bad input gets a clear ValueError naming the bad value or file, before any state changes.

Complements the error tests that live beside their modules (docs/reliability.md
has the full table): policy names and budgets (test_policies), cache creation
(test_cache), generate's prompts and context (test_generate), sha256 pins
(test_registry), GGUF / safetensors tensors (test_gguf_loader), the CLI (test_main).
"""

import json
import pathlib
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax import testing
from kvjax.cache import PagedKVCache
from kvjax.cache import attention
from kvjax.models import gguf_loader
from kvjax.models import safetensors_loader

CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=128, tie_embeddings=True)

B, L, K, H, PS = 2, 2, 2, 4, 4


@pytest.fixture(scope="module")
def lm():
  return kvjax.init_random(CONFIG, seed=0)


def _cache():
  return PagedKVCache.create(batch_size=B, capacity=[[8, 4], [8, 8]], num_layers=L,
                             num_kv_heads=K, head_dim=H, page_size=PS)


def _filled_cache():
  """A cache with a few entries, so 'nothing changed' means something."""
  cache = _cache()
  cache = cache.reserve(jnp.full((B, L, K), 3, jnp.int32))
  for layer in range(L):
    kv = jnp.arange(B * 3 * K * H, dtype=jnp.float32).reshape(B, 3, K, H) + layer
    slots = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (B, K, 3))
    cache = cache.write(layer, kv, kv, slots, jnp.broadcast_to(jnp.arange(3), (B, 3)))
    cache = cache.set_lengths(layer, jnp.full((B, K), 3, jnp.int32))
  return cache


# ------------------------------------------------------------------ generate


@pytest.mark.parametrize("kwargs, message", [
    # Budget above what any sequence of this model can hold.
    (dict(policy="snapkv", budget=129), "budget 129 exceeds the model's context of 128"),
    # Budget at or below what the policy always keeps (sinks).
    (dict(policy="streaming_llm", budget=4), "budget 4 must exceed the 4 entries"),
    (dict(policy=policies.get("chunkkv", chunk_length=80, window=8), budget=70),
     "budget 70 is below one chunk of 80 tokens"),
    (dict(policy=policies.get("snapkv", window=8), budget=8.5), "budget must be a positive int"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(page_size=4.0), "page_size must be a positive int, got 4.0"),
    (dict(pad_multiple=-1), "pad_multiple must be a positive int, got -1"),
    (dict(attention_block=0), "attention_block must be a positive int, got 0"),
    (dict(top_k=-1), r"top_k must be an int in \[0, 97\], got -1"),
    (dict(top_k=98), r"top_k must be an int in \[0, 97\], got 98"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(questions=[[1], [2]]), "1 prompts but 2 questions"),
    # Values of another type are refused, not converted.
    (dict(temperature=True), "temperature must be a finite number >= 0, got True"),
    (dict(policy="snapkv", budget=True), "budget must be a positive int, got True"),
    (dict(top_k=2.0), r"top_k must be an int in \[0, 97\], got 2.0"),
    (dict(seed=1.5), "seed must be an int, got 1.5"),
    (dict(stop_ids=[97]), r"stop_ids must be token ids in \[0, 97\), got 97"),
    (dict(query_aware="no"), "query_aware must be True or False, got 'no'"),
    (dict(chat_template=1), "chat_template must be True or False, got 1"),
    (dict(questions="?"), "this model has no tokenizer"),
])
def test_generate_rejects(lm, kwargs, message):
  with pytest.raises(ValueError, match=message):
    kvjax.generate(lm, [[1, 2, 3]], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("prompts, message", [
    ([[1.0, 2.0]], "prompt 0 has a token id 1.0 of type float; ids are ints"),
    ([[1, "2"]], "prompt 0 has a token id '2' of type str; ids are ints"),
    ([[1, True]], "prompt 0 has a token id True of type bool; ids are ints"),
    ([5], "prompt 0 must be a string or a list of token ids, got int"),
    ([None], "prompt 0 must be a string or a list of token ids, got NoneType"),
    (None, "prompts must be a string, a list of strings or a list of token-id lists"),
    ([], "prompts is empty"),
    ([[]], "prompt 0 is empty"),
    ([[1, 97]], r"prompt 0 has token ids outside \[0, 97\)"),
])
def test_generate_rejects_prompts(lm, prompts, message):
  with pytest.raises(ValueError, match=message):
    kvjax.generate(lm, prompts, max_new_tokens=2)


def test_generate_takes_numpy_ids(lm):
  ids = np.array([[1, 2, 3], [4, 5, 6]], np.int64)
  assert (kvjax.generate(lm, ids, max_new_tokens=2).token_ids
          == kvjax.generate(lm, ids.tolist(), max_new_tokens=2).token_ids)


def test_forward_rejects_a_prompt_longer_than_the_context(lm):
  with pytest.raises(ValueError, match="129 tokens exceed the model's context of 128"):
    lm.forward([[1] * 129])
  with pytest.raises(ValueError, match=r"token_ids must be \[B, T\], got shape \(3,\)"):
    lm.forward([1, 2, 3])


# ------------------------------------------------------------------ policies


@pytest.mark.parametrize("name, fields, message", [
    ("snapkv", dict(window=0), "policy 'snapkv': window must be an int >= 1, got 0"),
    ("snapkv", dict(kernel=4), "policy 'snapkv': kernel must be an odd int >= 1, got 4"),
    ("pyramidkv", dict(window="64"), "policy 'pyramidkv': window must be an int >= 1, got '64'"),
    ("pyramidkv", dict(beta=0), "policy 'pyramidkv': beta must be an int >= 1, got 0"),
    ("snapkv", dict(group="median"),
     r"policy 'snapkv': group must be one of \('mean', 'max'\), got 'median'"),
    ("h2o", dict(recent=-1), "policy 'h2o': recent must be an int >= 0, got -1"),
    ("h2o", dict(group="sum"), "policy 'h2o': group must be one of"),
    ("streaming_llm", dict(n_sink=True), "policy 'streaming_llm': n_sink must be an int >= 0"),
    ("chunkkv", dict(chunk_length=0), "policy 'chunkkv': chunk_length must be an int >= 1"),
    ("sentencekv", dict(delimiter_ids=(13, -1)),
     r"policy 'sentencekv': delimiter_ids must be a sequence of token ids \(ints >= 0\), got "
     r"\(13, -1\)"),
    ("sentencekv", dict(delimiter_ids="."), "delimiter_ids must be a sequence of token ids"),
])
def test_policy_field_values_are_checked_on_creation(name, fields, message):
  with pytest.raises(ValueError, match=message):
    policies.get(name, **fields)


def test_policy_list_field_becomes_a_hashable_tuple():
  policy = policies.get("sentencekv", delimiter_ids=[13, 30])
  assert policy.delimiter_ids == (13, 30)
  hash(policy)  # jit takes policies as static arguments


# ------------------------------------------------------------------ cache API


_COMPILED = jax.jit(lambda c, n: c.reserve(n))

GOOD = dict(
    k=np.zeros((B, 3, K, H), np.float32),
    slots=np.zeros((B, K, 3), np.int32),
    positions=np.zeros((B, 3), np.int32),
)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.reserve(jnp.zeros((B, L), jnp.int32)),
     r"new_lengths must have shape \[B, L, K\] = \(2, 2, 2\), got \(2, 2\)"),
    (lambda c: c.reserve(jnp.zeros((B, L, K), jnp.float32)),
     "new_lengths must be an int array, got dtype float32"),
    (lambda c: _COMPILED(c, jnp.zeros((B, L, K, 1), jnp.int32)),  # under jit too
     r"new_lengths must have shape \[B, L, K\] = \(2, 2, 2\), got \(2, 2, 2, 1\)"),
    (lambda c: c.write(0, GOOD["k"][:, :, :1], GOOD["k"], GOOD["slots"], GOOD["positions"]),
     r"k must have shape \[B, T, K, H\] = \(2, 'any', 2, 4\), got \(2, 3, 1, 4\)"),
    (lambda c: c.write(0, GOOD["k"], GOOD["k"][..., :2], GOOD["slots"], GOOD["positions"]),
     r"v must have shape \[B, T, K, H\] = \(2, 3, 2, 4\), got \(2, 3, 2, 2\)"),
    (lambda c: c.write(0, GOOD["k"].astype(np.int32), GOOD["k"], GOOD["slots"],
                       GOOD["positions"]),
     "k must be a float array, got dtype int32"),
    (lambda c: c.write(0, GOOD["k"], GOOD["k"], GOOD["slots"].astype(np.float32),
                       GOOD["positions"]),
     "slots must be an int array, got dtype float32"),
    (lambda c: c.write(0, GOOD["k"], GOOD["k"], GOOD["slots"][:, :, :2], GOOD["positions"]),
     r"slots must have shape \[B, K, T\] = \(2, 2, 3\), got \(2, 2, 2\)"),
    (lambda c: c.write(0, GOOD["k"], GOOD["k"], GOOD["slots"], GOOD["positions"][:1]),
     r"positions must have shape \[B, T\] = \(2, 3\), got \(1, 3\)"),
    (lambda c: c.write(0, GOOD["k"], GOOD["k"], GOOD["slots"], GOOD["positions"],
                       scores=np.zeros((B, K, 3), np.int32)),
     "scores must be a float array, got dtype int32"),
    (lambda c: c.write(2, GOOD["k"], GOOD["k"], GOOD["slots"], GOOD["positions"]),
     r"layer must be in \[0, 2\), got 2"),
    (lambda c: c.write(jnp.zeros(2, jnp.int32), GOOD["k"], GOOD["k"], GOOD["slots"],
                       GOOD["positions"]),
     r"layer must have shape \[\] = \(\), got \(2,\)"),
    (lambda c: c.append(0, GOOD["k"], GOOD["k"], GOOD["positions"]),
     r"k must have shape \[B, 1, K, H\] = \(2, 1, 2, 4\), got \(2, 3, 2, 4\)"),
    (lambda c: c.append(-1, GOOD["k"][:, :1], GOOD["k"][:, :1], GOOD["positions"][:, :1]),
     r"layer must be in \[0, 2\), got -1"),
    (lambda c: c.remove(jnp.zeros((B, K), jnp.int32)),
     r"slots must have shape \[B, L, K\] = \(2, 2, 2\), got \(2, 2\)"),
    (lambda c: c.set_lengths(0, jnp.zeros((B, L, K), jnp.int32)),
     r"lengths must have shape \[B, K\] = \(2, 2\), got \(2, 2, 2\)"),
    (lambda c: c.release(jnp.zeros((2, 2), jnp.int32)),
     r"pages must have shape \[M\] = \('any',\), got \(2, 2\)"),
    (lambda c: c.release(jnp.zeros((2,), jnp.float32)),
     "pages must be an int array, got dtype float32"),
    (lambda c: c.reset(jnp.ones((B + 1,), bool)),
     r"sequences must have shape \[B\] = \(2,\), got \(3,\)"),
    (lambda c: c.reset(jnp.ones((B,), jnp.int32)),
     "sequences must be a bool array, got dtype int32"),
])
def test_cache_methods_reject_bad_shapes_and_dtypes_untouched(call, message):
  cache = _filled_cache()
  before = jax.tree.map(np.asarray, cache)
  with pytest.raises(ValueError, match=message):
    call(cache)
  # Nothing is corrupted: the cache is a value and still the one we had.
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)
  testing.assert_cache_consistent(cache)


def _qkv(t=3, n=4, k=K, h=H, dtype=np.float32):
  rng = np.random.default_rng(0)
  return (rng.standard_normal((B, t, n, h)).astype(dtype),
          rng.standard_normal((B, t, k, h)).astype(dtype),
          rng.standard_normal((B, t, k, h)).astype(dtype))


def _positions(t=3):
  return np.broadcast_to(np.arange(t, dtype=np.int32), (B, t))


@pytest.mark.parametrize("call, message", [
    (lambda c: attention.prefill_attention(c, 0, *_qkv(k=1), _positions(), np.full(B, 3)),
     r"k must have shape \[B, T, K, H\] = \(2, 3, 2, 4\), got \(2, 3, 1, 4\)"),
    (lambda c: attention.prefill_attention(c, 0, *_qkv(h=8), _positions(), np.full(B, 3)),
     r"q must have shape \[B, T, N, H\] = \(2, 'any', 'any', 4\), got \(2, 3, 4, 8\)"),
    (lambda c: attention.prefill_attention(c, 0, *_qkv(n=3), _positions(), np.full(B, 3)),
     "query heads N=3 must be a multiple of the cache's KV heads K=2"),
    (lambda c: attention.prefill_attention(c, 0, *_qkv(dtype=np.int32), _positions(),
                                           np.full(B, 3)),
     "q must be a float array, got dtype int32"),
    (lambda c: attention.prefill_attention(c, 0, *_qkv(), _positions(), np.full(B + 1, 3)),
     r"lengths must have shape \[B\] = \(2,\), got \(3,\)"),
    (lambda c: attention.prefill_attention(c, 0, *_qkv(), _positions(), np.full(B, 3),
                                           tokens=np.zeros((B, 2), np.int32)),
     r"tokens must have shape \[B, T\] = \(2, 3\), got \(2, 2\)"),
    # Keeping every token of a 5-token prompt needs 5 slots; one head has 4.
    (lambda c: attention.prefill_attention(c, 0, *_qkv(t=5), _positions(5), np.full(B, 5)),
     "prompt of 5 tokens does not fit the cache: keeping every token needs a capacity of at "
     "least 5 per head, the smallest is 4"),
    (lambda c: attention.decode_attention(c, 0, *_qkv(t=2), _positions(2)),
     r"q must have shape \[B, T, N, H\] = \(2, 1, 'any', 4\), got \(2, 2, 4, 4\)"),
    (lambda c: attention.extend_attention(c, 0, *_qkv(), _positions(), np.full((B, 1), 3)),
     r"lengths must have shape \[B\] = \(2,\), got \(2, 1\)"),
])
def test_attention_entry_points_reject_bad_input_untouched(call, message):
  cache = _filled_cache()
  before = jax.tree.map(np.asarray, cache)
  with pytest.raises(ValueError, match=message):
    call(cache)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)


def test_a_selection_above_capacity_is_clamped_not_spilled():
  # Bad input that only a traced value reveals cannot raise; it must not corrupt.
  # A select keeping 8 tokens in a head of capacity 4: the head keeps the first 4,
  # its length stops at 4, and no other head or sequence changes.
  cache = _filled_cache().reset(jnp.array([True, False]))
  q, k, v = _qkv(t=8)
  keep_8 = lambda layer, prompt, q, k, v: (
      jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, K, 8)), None)
  other = jax.tree.map(np.asarray, cache)
  out, _ = attention.prefill_attention(cache, 0, q, k, v, _positions(8), np.full(B, 8),
                                       select=keep_8)
  testing.assert_cache_consistent(out)
  np.testing.assert_array_equal(out.lengths[:, 0], [[8, 4], [8, 4]])
  np.testing.assert_array_equal(out.kept_positions()[0, 0, 1, :4], np.arange(4))
  np.testing.assert_array_equal(out.lengths[:, 1], other.lengths[:, 1])


def test_invalid_page_ids_never_reach_the_free_stack():
  cache = _cache().reserve(jnp.full((B, L, K), 4, jnp.int32))
  released = cache.release(jnp.array([-1, cache.num_pages, 10**6], jnp.int32))
  np.testing.assert_array_equal(released.free_pages, cache.free_pages)
  assert int(released.num_free) == int(cache.num_free)
  testing.assert_cache_consistent(released)


# ------------------------------------------------------------------ model files


def _tiny_gguf(path: pathlib.Path) -> pathlib.Path:
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(1)
  writer.add_embedding_length(8)
  rng = np.random.default_rng(0)
  for name, shape in (("token_embd.weight", (16, 8)), ("output_norm.weight", (8,)),
                      ("blk.0.attn_q.weight", (8, 8))):
    writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, -4])
def test_truncated_gguf_names_the_file(tmp_path, keep):
  good = _tiny_gguf(tmp_path / "good.gguf").read_bytes()
  cut = int(len(good) * keep) if isinstance(keep, float) else keep % len(good)
  path = tmp_path / "cut.gguf"
  path.write_bytes(good[:cut])
  for read in (gguf_loader.load_gguf, gguf_loader.read_gguf_metadata, kvjax.load):
    with pytest.raises(ValueError, match="not a readable GGUF file") as info:
      read(path)
    assert str(info.value).startswith(f"{path}: "), info.value
    assert f"({cut} bytes; truncated or corrupt?)" in str(info.value)


def test_not_a_gguf_names_the_file(tmp_path):
  path = tmp_path / "junk.gguf"
  path.write_bytes(b"this is not a model" * 10)
  with pytest.raises(ValueError, match=r"junk\.gguf: not a readable GGUF file .*magic"):
    gguf_loader.load_gguf(path)


def _tiny_safetensors(folder: pathlib.Path) -> pathlib.Path:
  import safetensors.numpy as safetensors_numpy
  config = dict(model_type="llama", vocab_size=16, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=12,
                tie_word_embeddings=True)
  (folder / "config.json").write_text(json.dumps(config))
  shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,)}
  tensors = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
  safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
  return folder / "model.safetensors"


@pytest.mark.parametrize("keep", [4, 30, 0.5, -8])
def test_truncated_safetensors_names_the_file(tmp_path, keep):
  file = _tiny_safetensors(tmp_path)
  good = file.read_bytes()
  cut = int(len(good) * keep) if isinstance(keep, float) else keep % len(good)
  file.write_bytes(good[:cut])
  with pytest.raises(ValueError, match="not a readable safetensors file") as info:
    safetensors_loader.load_safetensors(tmp_path)
  assert str(info.value).startswith(f"{file}: "), info.value


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps(dict(model_type="llama", vocab_size=16)),
     r"required key\(s\) \['hidden_size', 'num_hidden_layers', 'num_attention_heads', "
     r"'intermediate_size'\] missing"),
])
def test_bad_config_json_names_the_file(tmp_path, text, message):
  _tiny_safetensors(tmp_path)
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ValueError, match=message) as info:
    safetensors_loader.load_safetensors(tmp_path)
  assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ")


def test_cli_truncated_model_exits_2_with_one_line(tmp_path):
  good = _tiny_gguf(tmp_path / "good.gguf").read_bytes()
  path = tmp_path / "cut.gguf"
  path.write_bytes(good[:len(good) // 2])
  out = subprocess.run([sys.executable, "-m", "kvjax.main", f"--model={path}"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {path}: not a readable GGUF file"), lines
