"""SentencePiece tokenizers (tokenizer.model): kvjax's ids against transformers' on one file.

The model is trained here, on the example document, with SentencePieceTrainer:
BPE with byte fallback and two user-defined symbols, as Gemma's has. The
reference is transformers' SentencePiece-based tokenizer class on the same file
with Llama 2's special tokens.
"""

import json

import numpy as np
import pytest
import sentencepiece

import kvjax
from kvjax.models.tokenizer import Tokenizer

TEXTS = [
    "The code to the lamp room's lock is 58213.",
    "  two  spaces and\ttabs",
    "<start_of_turn>user\nWhat is the code?<end_of_turn>\n<start_of_turn>model\n",
    "a</s>b <s> c",  # control tokens written in the text
    "x<unk>y",
    "Zebra ünïcode 42! 中文",  # characters the model never saw: byte fallback
    "\n\nnew lines\n",
    "",
]
SPECIALS = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A folder with tokenizer.model and tokenizer_config.json, and no tokenizer.json."""
  folder = tmp_path_factory.mktemp("spm")
  text = kvjax.tasks.example_document().text
  corpus = folder / "corpus.txt"
  corpus.write_text(text.replace(". ", ".\n"))
  sentencepiece.SentencePieceTrainer.Train(
      input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=600,
      model_type="bpe", byte_fallback=True, character_coverage=1.0,
      user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
      unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
  corpus.unlink()
  (folder / "tokenizer.vocab").unlink()
  (folder / "tokenizer_config.json").write_text(json.dumps(dict(SPECIALS, add_bos_token=True)))
  return folder


@pytest.fixture(scope="module")
def reference(folder):
  from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
  return SentencePieceBackend(vocab_file=str(folder / "tokenizer.model"), **SPECIALS)


@pytest.mark.parametrize("text", TEXTS + [None])  # None: the whole example document
def test_ids_match_transformers(folder, reference, text):
  text = kvjax.tasks.example_document().text if text is None else text
  ours = Tokenizer.from_file(folder)
  assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
  assert ours.encode(text, add_bos=None)[:1] == [1]  # add_bos_token from the config


def test_decoding_is_sentencepieces_own(folder):
  ours = Tokenizer.from_file(folder)
  sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
  for text in TEXTS:
    ids = ours.encode(text)
    plain = [i for i in ids if i not in (0, 1, 2, 3)]
    assert ours.decode(ids) == sp.decode(plain)  # control pieces and unk skipped
  assert ours.decode(ours.encode("Zebra ünïcode 42! 中文")) == "Zebra ünïcode 42! 中文"
  assert ours.decode(ours.encode("a</s>b"), skip_special_tokens=False) == "a</s>b"


def test_special_ids_and_vocabulary(folder):
  ours = Tokenizer.from_file(folder)
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 3, True)
  assert ours.stop_ids == (2,)
  assert ours.vocab_size == 600
  assert ours.token_to_id("<start_of_turn>") == 4 and ours.id_to_token(4) == "<start_of_turn>"
  assert ours.token_to_id("no such piece") is None and ours.token_to_id("<unk>") == 0
  # Without tokenizer_config.json the model's own ids serve.
  bare = folder.parent / "bare"
  bare.mkdir()
  (bare / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
  assert (Tokenizer.from_file(bare).bos_id, Tokenizer.from_file(bare).eos_id) == (1, 2)


def test_a_checkpoint_folder_with_a_sentencepiece_model_generates_from_text(folder, tmp_path):
  import safetensors.numpy
  v, d, f = 600, 32, 64
  config = dict(model_type="llama", vocab_size=v, hidden_size=d, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=f,
                max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True)
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "model.layers.0.input_layernorm.weight": (d,),
            "model.layers.0.post_attention_layernorm.weight": (d,),
            "model.layers.0.self_attn.q_proj.weight": (32, d),
            "model.layers.0.self_attn.k_proj.weight": (16, d),
            "model.layers.0.self_attn.v_proj.weight": (16, d),
            "model.layers.0.self_attn.o_proj.weight": (d, 32),
            "model.layers.0.mlp.gate_proj.weight": (f, d),
            "model.layers.0.mlp.up_proj.weight": (f, d),
            "model.layers.0.mlp.down_proj.weight": (d, f)}
  rng = np.random.default_rng(0)
  safetensors.numpy.save_file(
      {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in shapes.items()},
      str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(config))
  for name in ("tokenizer.model", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((folder / name).read_bytes())
  lm = kvjax.load(tmp_path)
  assert lm.tokenizer is not None and lm.tokenizer.vocab_size == v
  out = kvjax.generate(lm, ["The lamp room's lock"], max_new_tokens=4, stop_ids=[])
  assert len(out.token_ids[0]) == 4
  assert out.texts[0] == lm.tokenizer.decode(out.token_ids[0])
