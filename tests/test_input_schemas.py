"""Dataset rows and model files: every input checked where it enters, one schema per kind.

A bad value is a ValueError (DatasetError for datasets) naming the file, the
line or row, and the field or key; never another exception, never text made of
it, never an allocation first. docs/reliability.md ("Dataset rows and model
files") has the table.
"""

import json
import math
import pathlib
import tracemalloc

import gguf
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

import kvjax
from kvjax.models import config as config_lib
from kvjax.models import gguf_loader
from kvjax.models import safetensors_loader
from kvjax.models import tokenizer as tokenizer_lib
from kvjax.tasks import dataset as dataset_lib
from kvjax.tasks.dataset import DatasetError

# A tiny Llama: V=260 (256 bytes, one merge, three specials), D=8, L=1, N=2, K=1, H=4, F=12.
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
TOKENS = tuple(sorted(pre_tokenizers.ByteLevel.alphabet())) + ("ab",) + SPECIALS
V, D, L, N, KV, H, F = len(TOKENS), 8, 1, 2, 1, 4, 12
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }"  # an unclosed for and tag

# Per-layer tensor stem -> [out, in] shape, in GGUF and (after the dot) Hugging Face names.
LAYER = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (N * H, D), "attn_k": (KV * H, D),
         "attn_v": (KV * H, D), "attn_output": (D, N * H), "ffn_gate": (F, D),
         "ffn_up": (F, D), "ffn_down": (D, F)}
HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

GGUF_META = {
    "llama.block_count": ("uint32", L),
    "llama.context_length": ("uint32", 64),
    "llama.embedding_length": ("uint32", D),
    "llama.feed_forward_length": ("uint32", F),
    "llama.attention.head_count": ("uint32", N),
    "llama.attention.head_count_kv": ("uint32", KV),
    "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "llama.rope.freq_base": ("float32", 10000.0),
}


def write_gguf(path: pathlib.Path, meta=None, template=TEMPLATE) -> pathlib.Path:
  """A tiny Llama GGUF with a byte-level BPE tokenizer; ``meta`` overrides GGUF_META keys."""
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, (kind, value) in {**GGUF_META, **(meta or {})}.items():
    if value is not None:
      getattr(writer, f"add_{kind}")(key, value)
  writer.add_tokenizer_model("gpt2")
  writer.add_token_list(list(TOKENS))
  writer.add_token_merges(["a b"])
  writer.add_token_types([1] * (V - len(SPECIALS)) + [3] * len(SPECIALS))
  writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
  if template is not None:
    writer.add_chat_template(template)
  rng = np.random.default_rng(0)
  tensors = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
  tensors.update({f"blk.{i}.{stem}.weight": shape for i in range(L) for stem, shape in LAYER.items()})
  for name, shape in tensors.items():
    writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


HF_CONFIG = dict(model_type="llama", vocab_size=V, hidden_size=D, num_hidden_layers=L,
                 num_attention_heads=N, num_key_value_heads=KV, head_dim=H,
                 intermediate_size=F, max_position_embeddings=64, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)


def write_checkpoint(folder: pathlib.Path, config=None, tokenizer=None) -> pathlib.Path:
  """A tiny Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer?)."""
  import safetensors.numpy as safetensors_numpy
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(HF_CONFIG if config is None else config))
  rng = np.random.default_rng(0)
  shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
  shapes.update({f"model.layers.{i}.{HF_NAMES[stem]}.weight": shape
                 for i in range(L) for stem, shape in LAYER.items()})
  tensors = {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in shapes.items()}
  safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
  if tokenizer is not None:
    tokenizer.backend.save(str(folder / "tokenizer.json"))
  return folder


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tok(gguf_path):
  return tokenizer_lib.Tokenizer.from_gguf(gguf_path)


def test_the_fixtures_load(gguf_path, tok, tmp_path):
  """The good files these tests break load, so each failure below is the broken value's."""
  lm = kvjax.load(gguf_path)
  assert lm.config.num_layers == L and lm.config.vocab_size == V
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
  folder = write_checkpoint(tmp_path / "ckpt", tokenizer=tok)
  assert kvjax.load(folder).tokenizer.encode("ab") == tok.encode("ab")


# ------------------------------------------------------------------ dataset rows

GOOD_ROW = {"context": "The code is 42.", "question": "What is the code?", "answer": "42"}

BAD_FIELDS = [
    ("context", None), ("context", ["a", "b"]), ("context", 3), ("context", ""),
    ("context", "  \n "), ("context", {"text": "a"}), ("context", True), ("context", 2.5),
    ("question", None), ("question", 7), ("question", ["q"]), ("question", {}),
    ("answer", 42), ("answer", None), ("answer", []), ("answer", [1, 2]), ("answer", ["a", None]),
    ("answer", {"text": "a"}), ("answer", True), ("answer", 4.2), ("answer", [["nested"]]),
    ("answer_prefix", 3), ("answer_prefix", ["Answer:"]), ("answer_prefix", True),
    ("max_new_tokens", 0), ("max_new_tokens", -1), ("max_new_tokens", 1.5),
    ("max_new_tokens", 32.0), ("max_new_tokens", "32"), ("max_new_tokens", True),
    ("max_new_tokens", [32]),
    ("id", 1.5), ("id", True), ("id", [1]), ("id", {"k": 1}),
    ("metric", ""), ("metric", 3), ("metric", ["qa_f1"]),
    ("all_classes", "a, b"), ("all_classes", [1, 2]), ("all_classes", {"a": 1}),
    ("all_classes", ["a", None]), ("all_classes", 5),
]


def _write_jsonl(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
  path.write_text("\n".join(lines) + "\n")
  return path


@pytest.mark.parametrize("field, value", BAD_FIELDS)
def test_a_field_of_the_wrong_type_names_file_line_and_field(tok, tmp_path, field, value):
  # Line 1 good, line 2 blank, line 3 bad: the message counts lines of the file.
  path = _write_jsonl(tmp_path / "data.jsonl",
                      [json.dumps(GOOD_ROW), "", json.dumps({**GOOD_ROW, "id": "b", field: value})])
  for read in (dataset_lib.read_rows, lambda p: dataset_lib.dataset_samples(tok, p)):
    with pytest.raises(DatasetError) as info:
      read(path)
    assert str(info.value).startswith(f"{path}: line 3: field {field!r} must be "), info.value
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", [
    '{"context": "\\ud800", "question": "q", "answer": "a"}',  # a lone surrogate
    '{"context": "c", "question": "q", "answer": ["ok", "\\udfff"]}',
])
def test_a_string_that_is_not_text_is_refused(tmp_path, text):
  path = _write_jsonl(tmp_path / "data.jsonl", [text])
  with pytest.raises(DatasetError, match=r"line 1: field '(context|answer)' must be"):
    dataset_lib.read_rows(path)


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "line 1: JSON nested too deeply to read"),
    ('{"context": ' + "[" * 100_000 + "]" * 100_000 + ', "question": "q", "answer": "a"}',
     "line 1: JSON nested too deeply to read"),
    ('{"context": 1' + "0" * 5000 + ', "question": "q", "answer": "a"}',
     "line 1: not a readable JSON line"),
    ("[1, 2]", r"line 1: not an object \(got list \[1, 2\]\)"),
    ('"a string"', "line 1: not an object"),
    ("3", "line 1: not an object"),
    ("null", "line 1: not an object"),
    ("true", "line 1: not an object"),
    ('{"context": "c", "question": "q"}', r"line 1: lacks \['answer'\]"),
    ("{}", r"line 1: lacks \['context', 'question', 'answer'\]"),
    ('{"context": "c", "question": "q", "answer": NaN}', "field 'answer' must be"),
    ('{"context": "c", "question": "q", "answer": "a", "max_new_tokens": Infinity}',
     "field 'max_new_tokens' must be a positive int"),
    ("{not json}", "line 1: not a JSON line"),
    ('{"context": "c"', "line 1: not a JSON line"),
])
def test_unreadable_and_non_object_lines_name_the_line(tmp_path, line, message):
  path = _write_jsonl(tmp_path / "data.jsonl", [line])
  with pytest.raises(DatasetError, match=message) as info:
    dataset_lib.read_rows(path)
  assert str(info.value).startswith(f"{path}: line 1: ")


def test_invalid_utf8_is_refused_with_its_line_and_a_bom_is_skipped(tmp_path):
  good = json.dumps(GOOD_ROW).encode()
  path = tmp_path / "data.jsonl"
  path.write_bytes(good + b"\n" + good.replace(b'"c', b'"\xff c', 1) + b"\n")
  with pytest.raises(DatasetError, match=r"data.jsonl: line 2: not UTF-8 \(byte \d+ of the "
                                         r"line, b'\\xff'\)"):
    dataset_lib.read_rows(path)
  path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good + b"\n")
  assert len(dataset_lib.read_rows(path)) == 2


def test_duplicate_ids_are_refused_with_both_lines(tmp_path):
  rows = [{**GOOD_ROW, "id": "q1"}, {**GOOD_ROW, "id": "q2"}, {**GOOD_ROW, "id": "q1"}]
  path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps(r) for r in rows])
  with pytest.raises(DatasetError, match=r"line 1 and line 3 share the id 'q1'"):
    dataset_lib.read_rows(path)
  # An int id and the same digits as a string are the same id in results.
  path = _write_jsonl(tmp_path / "ints.jsonl", [json.dumps({**GOOD_ROW, "id": 7}),
                                                json.dumps({**GOOD_ROW, "id": "7"})])
  with pytest.raises(DatasetError, match="share the id '7'"):
    dataset_lib.read_rows(path)


def test_an_unknown_metric_is_refused_when_the_names_are_given(tmp_path):
  path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps({**GOOD_ROW, "metric": "f2"})])
  assert dataset_lib.read_rows(path)[0]["metric"] == "f2"  # any name without a list
  with pytest.raises(DatasetError, match=r"line 1: field 'metric' must be one of qa_f1, "
                                         r"contains, got 'f2'"):
    dataset_lib.read_rows(path, metrics=("qa_f1", "contains"))


def test_null_optional_fields_take_the_defaults(tok, tmp_path):
  row = {**GOOD_ROW, "answer": ["42", "forty-two"], "id": None, "metric": None,
         "max_new_tokens": None, "all_classes": None, "answer_prefix": None, "extra": [1, {}]}
  path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps(row)])
  (sample,) = dataset_lib.dataset_samples(tok, path, metric="contains", max_new_tokens=9)
  assert (sample.id, sample.metric, sample.max_new_tokens) == ("0", "contains", 9)
  assert sample.answers == ("42", "forty-two") and sample.all_classes == ()
  assert sample.question.endswith("<|im_start|>assistant\n")


def test_a_parquet_row_names_its_row(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  path = tmp_path / "data.parquet"
  pq.write_table(pa.table({"context": ["a", "b"], "question": ["q", "q"],
                           "answer": ["x", None]}), path)
  with pytest.raises(DatasetError, match=r"data\.parquet: row 2: field 'answer' must be a "
                                         r"string or a non-empty list of strings, got NoneType"):
    dataset_lib.read_rows(path)


def test_a_model_without_a_tokenizer_cannot_make_dataset_samples(tmp_path):
  path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps(GOOD_ROW)])
  with pytest.raises(ValueError, match="this model has no tokenizer"):
    dataset_lib.dataset_samples(None, path)


# Any JSON value, as a dataset row could hold it (a lone surrogate included).
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.just("\ud800"),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
_TEXT = st.text(max_size=12)
_GOOD = {
    "context": _TEXT.filter(str.strip), "question": _TEXT,
    "answer": st.one_of(_TEXT, st.lists(_TEXT, min_size=1, max_size=3)),
    "answer_prefix": _TEXT, "max_new_tokens": st.integers(1, 64),
    "id": st.one_of(_TEXT, st.integers(-5, 10**20)), "metric": st.sampled_from(["qa_f1", "em"]),
    "all_classes": st.lists(_TEXT, max_size=3),
}


def _mostly(good, other, odds: int):
  """``good`` ``odds`` times out of ``odds + 1``, else ``other``."""
  return st.integers(0, odds).flatmap(lambda i: other if i == 0 else good)


# Mostly good values, so that rows that pass are drawn too.
_ROW = st.fixed_dictionaries(
    {f: _mostly(_GOOD[f], _VALUES, 6) for f in dataset_lib.REQUIRED},
    optional={f: _mostly(_GOOD[f], _VALUES, 3) for f in dataset_lib.SCHEMA
              if f not in dataset_lib.REQUIRED})
_ROWS = _mostly(_ROW, _VALUES, 8)


def _check_sample(sample, row: dict, index: int) -> None:
  """A sample holds the row's values, as strings, never text made of another type."""
  answers = (row["answer"],) if isinstance(row["answer"], str) else tuple(row["answer"])
  assert sample.answers == answers and row["question"] in sample.question
  assert sample.id == (str(row["id"]) if row.get("id") is not None else str(index))
  assert sample.metric == (row.get("metric") or "qa_f1")
  assert sample.max_new_tokens == (row.get("max_new_tokens") or 32)
  assert sample.all_classes == tuple(row.get("all_classes") or ())
  assert all(isinstance(x, str) for x in (sample.context, sample.question, sample.id,
                                          sample.metric, *sample.answers, *sample.all_classes))


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(rows=st.lists(_ROWS, min_size=1, max_size=3))
def test_any_rows_become_samples_of_strings_or_a_dataset_error(tok, tmp_path_factory, rows):
  """Every row either becomes a Sample with string fields, or a DatasetError naming it."""
  path = tmp_path_factory.mktemp("rows") / "data.jsonl"
  _write_jsonl(path, [json.dumps(r) for r in rows])
  try:
    samples = dataset_lib.dataset_samples(tok, path)
  except DatasetError as e:
    assert str(e).startswith(f"{path}: line "), e
    known = ("not an object", "lacks", "share the id", *(f"field {f!r}" for f in dataset_lib.SCHEMA))
    assert any(k in str(e) for k in known), e
    return
  assert len(samples) == len(rows)
  for index, (sample, row) in enumerate(zip(samples, rows)):
    _check_sample(sample, row, index)


# ------------------------------------------------------------------ config.json

BAD_CONFIG_VALUES = [
    ("vocab_size", 0), ("vocab_size", -1), ("vocab_size", 1.5), ("vocab_size", "260"),
    ("vocab_size", True), ("vocab_size", None), ("vocab_size", [260]),
    ("hidden_size", 0), ("hidden_size", 8.0), ("hidden_size", -8),
    ("num_hidden_layers", 0), ("num_hidden_layers", "1"), ("num_hidden_layers", False),
    ("num_attention_heads", 0), ("num_attention_heads", -2),
    ("num_key_value_heads", 0), ("num_key_value_heads", -1), ("num_key_value_heads", 1.0),
    ("head_dim", 3), ("head_dim", -4), ("head_dim", "4"),
    ("intermediate_size", 0), ("intermediate_size", -12), ("intermediate_size", 12.5),
    ("max_position_embeddings", -1), ("max_position_embeddings", 0),
    ("max_position_embeddings", "64"), ("max_position_embeddings", 64.0),
    ("rope_theta", -1.0), ("rope_theta", 0), ("rope_theta", "10000"), ("rope_theta", True),
    ("rope_theta", float("nan")), ("rope_theta", float("inf")), ("rope_theta", None),
    ("rms_norm_eps", 0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", "1e-6"),
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 1),
    ("num_key_value_heads", 3),  # N=2 is not a multiple of K=3
]


@pytest.mark.parametrize("key, value", BAD_CONFIG_VALUES)
def test_a_bad_config_value_names_the_file_and_key(tmp_path, key, value):
  folder = write_checkpoint(tmp_path, config={**HF_CONFIG, key: value})
  for load in (safetensors_loader.load_safetensors, kvjax.load):
    with pytest.raises(ValueError) as info:
      load(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.json'}: "), message
    assert key in message and "must be" in message, message


@pytest.mark.parametrize("key", safetensors_loader._REQUIRED)
def test_a_missing_dimension_names_the_file_and_key(tmp_path, key):
  config = {k: v for k, v in HF_CONFIG.items() if k != key}
  folder = write_checkpoint(tmp_path, config=config)
  with pytest.raises(ValueError, match=rf"config\.json: required key\(s\) \['{key}'\] missing"):
    kvjax.load(folder)


@pytest.mark.parametrize("changes, message", [
    (dict(head_dim=None, hidden_size=9), r"hidden_size \(9\) is not a multiple of "
                                         r"num_attention_heads \(2\)"),
    (dict(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}),
     "rope scaling: factor is missing"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     "rope scaling: RopeScaling.factor must be a finite positive number, got -8.0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": "64"}),
     "original_max_position_embeddings must be a positive int"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     "rope scaling: factor must be a finite number, got '8'"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be an object or null"),
    # Absurd sizes: refused by the parameter bound before any allocation.
    (dict(num_hidden_layers=10**12), r"num_hidden_layers=1000000000000.* imply 4\.96e\+14 parameters .* a dimension is wrong"),
    (dict(hidden_size=10**7, head_dim=None, num_attention_heads=10**6),
     "a dimension is wrong"),
    # Large but under the bound: every tensor's header is checked before any weight is read.
    (dict(vocab_size=10**11), r"'model\.embed_tokens\.weight' expected shape \(100000000000, 8\)"),
    (dict(num_hidden_layers=10**9), r"required tensor 'model\.layers\.1\.input_layernorm"),
    (dict(intermediate_size=10**9), r"expected shape \(1000000000, 8\), got \(12, 8\)"),
])
def test_absurd_or_inconsistent_configs_fail_before_allocating(tmp_path, changes, message):
  folder = write_checkpoint(tmp_path, config={**HF_CONFIG, **changes})
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=message) as info:
      safetensors_loader.load_safetensors(folder)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert str(info.value).startswith(str(folder)), info.value
  assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB traced before the error"


def test_weights_larger_than_the_machine_are_refused_before_reading(tmp_path, monkeypatch,
                                                                    gguf_path):
  folder = write_checkpoint(tmp_path)
  monkeypatch.setattr(config_lib, "physical_memory", lambda: 1000)
  with pytest.raises(ValueError, match=r"the weights need .* GiB of host memory .* more than "
                                       r"this machine's"):
    kvjax.load(folder)
  with pytest.raises(ValueError, match=f"{gguf_path}: the weights need"):
    kvjax.load(gguf_path)
  monkeypatch.setattr(config_lib, "physical_memory", lambda: None)  # unknown: no check
  assert kvjax.load(folder).config.num_layers == L


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=0), "LlamaConfig: vocab_size must be a positive int, got 0"),
    (dict(num_layers=True), "num_layers must be a positive int, got True"),
    (dict(max_position_embeddings=-1), "max_position_embeddings must be a positive int"),
    (dict(rope_theta=-10000.0), "rope_theta must be a finite positive number"),
    (dict(rope_theta=math.inf), "rope_theta must be a finite positive number"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a finite positive number"),
    (dict(num_kv_heads=3), r"num_heads must be a multiple of num_kv_heads \(3\)"),
    (dict(head_dim=5), "head_dim must be even"),
    (dict(tie_embeddings="no"), "tie_embeddings must be true or false"),
    (dict(rope_scaling={"factor": 8}), "rope_scaling must be a RopeScaling or None"),
    (dict(num_layers=10**8, hidden_size=4096, head_dim=2048), "a dimension is wrong"),
])
def test_llama_config_checks_every_field(kwargs, message):
  base = dict(vocab_size=V, hidden_size=D, num_layers=L, num_heads=N, num_kv_heads=KV,
              head_dim=H, intermediate_size=F)
  with pytest.raises(ValueError, match=message):
    kvjax.LlamaConfig(**{**base, **kwargs})


# ------------------------------------------------------------------ GGUF metadata


@pytest.mark.parametrize("key, kind, value, message", [
    ("llama.embedding_length", "uint32", 0, "must be a positive int, got 0"),
    ("llama.block_count", "int32", -1, "must be a positive int, got -1"),
    ("llama.block_count", "string", "1", "must be a positive int, got '1'"),
    ("llama.block_count", "float32", 1.0, "must be a positive int, got 1.0"),
    ("llama.block_count", "bool", True, "must be a positive int, got True"),
    ("llama.attention.head_count", "uint32", 0, "must be a positive int"),
    ("llama.attention.head_count_kv", "uint32", 3, r"must be a multiple of "
                                                   r"llama\.attention\.head_count_kv \(3\)"),
    ("llama.attention.key_length", "uint32", 3, "must be even"),
    ("llama.feed_forward_length", "int32", -12, "must be a positive int"),
    ("llama.context_length", "int32", -5, "must be a positive int, got -5"),
    ("llama.context_length", "uint32", 0, "must be a positive int, got 0"),
    ("llama.rope.freq_base", "float32", -1.0, "must be a finite positive number, got -1.0"),
    ("llama.rope.freq_base", "float32", 0.0, "must be a finite positive number"),
    ("llama.rope.freq_base", "string", "1e4", "must be a finite positive number"),
    ("llama.attention.layer_norm_rms_epsilon", "float32", -1e-6, "finite positive number"),
    ("llama.embedding_length", None, None, "metadata key 'llama.embedding_length' is missing"),
    ("llama.feed_forward_length", None, None, "'llama.feed_forward_length' is missing"),
    ("llama.block_count", "uint32", 10**9, r"required tensor 'blk\.1\.attn_norm\.weight'"),
    ("llama.block_count", "uint32", 4 * 10**9, "a dimension is wrong"),
    ("llama.embedding_length", "uint32", 9, r"embedding_length \(9\) is not a multiple"),
])
def test_bad_gguf_metadata_names_the_file_and_key(tmp_path, key, kind, value, message):
  path = write_gguf(tmp_path / "bad.gguf", meta={key: (kind, value)})
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=message) as info:
      gguf_loader.load_gguf(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert str(info.value).startswith(f"{path}: "), info.value
  if "must be" in message:
    assert key in str(info.value)
  assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB traced before the error"


# ------------------------------------------------------------------ tokenizers


def test_a_folder_without_a_tokenizer_loads_and_names_what_is_missing(tmp_path, tok):
  folder = write_checkpoint(tmp_path / "ckpt")
  lm = kvjax.load(folder)
  assert lm.tokenizer is None
  out = kvjax.generate(lm, [[1, 2, 3]], max_new_tokens=2)  # token ids need no tokenizer
  assert 1 <= len(out.token_ids[0]) <= 2
  missing = rf"{folder}: no tokenizer\.json or tokenizer\.model in the folder"
  with pytest.raises(ValueError, match=missing + r", so the prompts cannot be encoded"):
    lm.require_tokenizer("the prompts")
  with pytest.raises(ValueError, match=missing + r", so prompt 0 \(a string\) cannot be "
                                                 r"encoded"):
    kvjax.generate(lm, ["text"], max_new_tokens=2)
  (folder / "vocab.json").write_text("{}")
  with pytest.raises(ValueError, match=r"it has vocab\.json, which kvjax does not read"):
    lm.require_tokenizer()
  (folder / "tokenizer.model").write_bytes(b"\0")
  with pytest.raises(ValueError, match=r"tokenizer\.model: not a readable SentencePiece model"):
    kvjax.load(folder)
  random = kvjax.init_random(kvjax.LlamaConfig(V, D, L, N, KV, H, F))
  with pytest.raises(ValueError, match="random:0: this model has no tokenizer"):
    random.require_tokenizer()


def test_a_broken_gguf_chat_template_loads_and_fails_at_chat_time(tmp_path):
  path = write_gguf(tmp_path / "broken.gguf", template=BROKEN_TEMPLATE)
  lm = kvjax.load(path)  # the template is not needed to load, nor for plain text
  assert lm.tokenizer.decode(lm.tokenizer.encode("ab c")) == "ab c"
  assert 1 <= len(kvjax.generate(lm, ["ab"], max_new_tokens=2).token_ids[0]) <= 2
  expected = rf"the chat template of {path} \(tokenizer\.chat_template\) does not compile: "
  for _ in range(2):  # every call reports it, not only the first
    with pytest.raises(ValueError, match=expected + r".*\(template line 1\)"):
      lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match=expected):
    kvjax.generate(lm, ["hi"], max_new_tokens=2, chat_template=True)
  assert lm.tokenizer.chatml([{"role": "user", "content": "hi"}]).startswith("<|im_start|>")


def test_weights_the_config_does_not_account_for_are_refused(tmp_path):
  """config.json says 1 layer, the weights hold 2: an error naming layer 1's tensors, not
  a model that silently drops them. RoPE's stored inverse frequencies are no weights."""
  import safetensors.numpy as safetensors_numpy
  folder = write_checkpoint(tmp_path / "ckpt")
  tensors = safetensors_numpy.load_file(str(folder / "model.safetensors"))
  extra = {k.replace("layers.0.", "layers.1."): v for k, v in tensors.items() if "layers.0." in k}
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(H // 2, np.float32)
  safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
  kvjax.load(folder)
  safetensors_numpy.save_file({**tensors, **extra}, str(folder / "model.safetensors"))
  with pytest.raises(ValueError, match=r"ckpt: the weights hold 9 tensor\(s\) that config.json "
                                       r"\(num_hidden_layers=1\) does not account for: 'model.layers.1."):
    kvjax.load(folder)


def test_a_folder_without_tokenizer_config_generates(tmp_path, tok):
  """No tokenizer_config.json: no EOS and no pad id; generate still runs (to its stop ids
  or max_new_tokens), not a TypeError."""
  lm = kvjax.load(write_checkpoint(tmp_path / "ckpt", tokenizer=tok))
  assert lm.tokenizer.pad_id is None and lm.tokenizer.eos_id is None
  result = kvjax.generate(lm, ["ab", "abc d"], max_new_tokens=3)
  assert all(1 <= len(row) <= 3 for row in result.token_ids)


@pytest.mark.parametrize("files, origin, message", [
    ({"tokenizer_config.json": json.dumps({"chat_template": BROKEN_TEMPLATE})},
     r"tokenizer_config\.json \(chat_template\)", "does not compile"),
    ({"tokenizer_config.json": json.dumps({"chat_template": [
        {"name": "default", "template": BROKEN_TEMPLATE}]})},
     r"tokenizer_config\.json \(chat_template\)", "does not compile"),
    ({"chat_template.jinja": "{{ messages[0]['content'] }} {% endif %}"},
     r"chat_template\.jinja", "does not compile"),
    ({"tokenizer_config.json": json.dumps({"chat_template": 5})},
     r"tokenizer_config\.json \(chat_template\)", "is not a string: int"),
    ({"chat_template.jinja": "{{ raise_exception('no system role') }}"},
     r"chat_template\.jinja", "failed: no system role"),
    ({"chat_template.jinja": "{{ messages.__class__.__mro__ }}"},
     r"chat_template\.jinja", "failed: access to attribute"),
])
def test_a_folder_chat_template_fails_at_chat_time_naming_its_file(tmp_path, tok, files,
                                                                   origin, message):
  folder = write_checkpoint(tmp_path / "ckpt", tokenizer=tok)
  for name, text in files.items():
    (folder / name).write_text(text)
  lm = kvjax.load(folder)
  assert lm.tokenizer.encode("ab") == tok.encode("ab")
  with pytest.raises(ValueError, match=f"the chat template of .*{origin}.* {message}"):
    lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_config.json", "[1]", r"tokenizer_config\.json: expected a JSON object, got list"),
    ("tokenizer_config.json", '{"eos_token": 5}', r"tokenizer_config\.json: eos_token must be a "
                                                   r"string"),
    ("generation_config.json", '{"eos_token_id": "2"}',
     r"generation_config\.json: eos_token_id must be a token id"),
    ("generation_config.json", '{"eos_token_id": [2, 1.5]}',
     r"generation_config\.json: eos_token_id must be a token id"),
    ("tokenizer.json", "{}", r"tokenizer\.json: not a readable tokenizer\.json"),
    ("config.json", "[" * 100_000, r"config\.json: not valid JSON"),
    ("model.safetensors.index.json", '{"weight_map": [1]}',
     r"model\.safetensors\.index\.json: weight_map must be an object"),
])
def test_bad_folder_files_name_the_file(tmp_path, tok, name, text, message):
  folder = write_checkpoint(tmp_path / "ckpt", tokenizer=tok)
  (folder / name).write_text(text)
  with pytest.raises(ValueError, match=message) as info:
    kvjax.load(folder)
  assert str(info.value).startswith(str(folder / name)), info.value
