"""Tests for kvjax.models.tokenizer against transformers on the SmolLM2 GGUF."""

import dataclasses
import json
import os

import pytest

from kvjax.models import registry
from kvjax.models import tokenizer as tokenizer_lib
from kvjax.models.gguf_loader import read_gguf_metadata

SMOLLM2 = registry.KNOWN_MODELS["smollm2-135m-instruct"]

TEXTS = [
    "The pass key is 68213.",
    "Hello, world! It's a test: don't, we'll, they've, I'M.",
    "def f(x):\n    return x**2  # square\n\tif x: pass\n",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "Emoji 🎉👍🏽 and a family 👨‍👩‍👧 ok",
    "   lots    of\n\n\n  whitespace \t\t end   ",
    "<|im_start|>user\nWhat is the pass key?<|im_end|>\n<|endoftext|>",
    "glued<|im_end|>text<repo_name>more",
    "12,345.67e-8 and 2024-01-31 at 10:45",
    " leading space and trailing newline\n",
    "Ünïcödé àçcénts — “quotes” …",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Line one\n  line two {{ not jinja }}"}],
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_path):
  return smollm2_path


@pytest.fixture(scope="module")
def tok(gguf_path):
  return tokenizer_lib.Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path))


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
  import transformers
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  return transformers.AutoTokenizer.from_pretrained(
      str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf_tok, text):
  # transformers' GGUF tokenizer prepends a (wrong) BOS; compare the text's own ids.
  assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, hf_tok, text):
  ids = tok.encode(text)
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_matched_whole_and_skipped(tok):
  assert tok.encode("<|im_start|>") == [1]
  assert tok.encode("a<|im_end|>") == tok.encode("a") + [2]
  assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_digits_are_split_one_by_one(tok):
  ids = tok.encode("The pass key is 68213.")
  assert [tok.id_to_token(i) for i in ids[-6:]] == ["6", "8", "2", "1", "3", "."]


def test_smollm_pre_tokenizer_splits_every_number_character(tok):
  # llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's tokenizer.json) split each
  # \p{N} character off first, so " ½" is "Ġ" + "½". transformers' GGUF
  # conversion ignores tokenizer.ggml.pre and would give "Ġ½" here.
  assert [tok.id_to_token(i) for i in tok.encode(" ½")] == ["Ġ", "Â½"]


def test_special_ids_and_sizes(tok):
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
  assert tok.id_to_token(tok.eos_id) == "<|im_end|>"
  assert tok.stop_ids[0] == tok.eos_id
  assert tok.token_to_id("<|im_end|>") in tok.stop_ids
  assert tok.token_to_id("<|endoftext|>") in tok.stop_ids
  assert tok.vocab_size == 49152
  assert not tok.add_bos


def test_add_bos_and_batch(tok):
  assert tok.encode("hi", add_bos=True) == [tok.bos_id] + tok.encode("hi")
  assert tok.encode("hi", add_bos=None) == tok.encode("hi")  # the GGUF says no BOS
  assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
  assert tok.encode_batch(["a", "b"], add_bos=True) == [[1] + tok.encode("a"), [1] + tok.encode("b")]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
  ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  ref = hf_tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
  assert ours == ref


def test_template_injects_system_prompt_but_chatml_does_not(tok):
  messages = [{"role": "user", "content": "What is the pass key?"}]
  templated = tok.apply_chat_template(messages)
  assert templated.startswith("<|im_start|>system\nYou are a helpful AI assistant")
  plain = tok.chatml(messages)
  assert plain == "<|im_start|>user\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\n"
  assert tok.chatml(messages, add_generation_prompt=False) == \
      "<|im_start|>user\nWhat is the pass key?<|im_end|>\n"
  with_system = [{"role": "system", "content": "S"}] + messages
  assert tok.chatml(with_system) == tok.apply_chat_template(with_system)
  assert tok.encode(plain)[0] == tok.token_to_id("<|im_start|>")


def test_bad_messages_are_rejected(tok):
  with pytest.raises(ValueError, match="message 0"):
    tok.apply_chat_template([{"role": "user"}])
  with pytest.raises(ValueError, match="message 1"):
    tok.chatml([{"role": "user", "content": "a"}, ("user", "b")])


def test_from_file_matches_gguf_tokenizer(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
      "pad_token": None, "chat_template": tok.chat_template}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  other = tokenizer_lib.Tokenizer.from_file(tmp_path)
  assert [other.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
  assert (other.bos_id, other.eos_id, other.pad_id) == (1, 2, 2)
  assert set(other.stop_ids) == {0, 2} and other.stop_ids[0] == 2
  for messages in CONVERSATIONS:
    assert other.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_file_reads_chat_template_jinja(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  other = tokenizer_lib.Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert other.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
  assert other.eos_id is None and other.pad_id is None


def test_unsupported_gguf_tokenizers_are_rejected(gguf_path):
  data = read_gguf_metadata(gguf_path).tokenizer
  with pytest.raises(ValueError, match="'tekken'"):
    tokenizer_lib.Tokenizer.from_gguf_metadata(dataclasses.replace(data, pre="tekken"))
  with pytest.raises(ValueError, match="'bert'"):
    tokenizer_lib.Tokenizer.from_gguf_metadata(dataclasses.replace(data, model="bert"))
  # SentencePiece ('llama', Gemma's) needs a score per token; this vocabulary has none.
  with pytest.raises(ValueError, match="0 tokenizer.ggml.scores"):
    tokenizer_lib.Tokenizer.from_gguf_metadata(dataclasses.replace(data, model="llama"))
  with pytest.raises(ValueError, match="add_space_prefix"):
    tokenizer_lib.Tokenizer.from_gguf_metadata(dataclasses.replace(
        data, model="llama", scores=(0.0,) * len(data.tokens), add_space_prefix=True))


def test_no_chat_template_is_an_error(gguf_path):
  data = dataclasses.replace(read_gguf_metadata(gguf_path).tokenizer, chat_template=None)
  tok = tokenizer_lib.Tokenizer.from_gguf_metadata(data)
  with pytest.raises(ValueError, match="chatml"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gemma_turns_render_as_gemma_s_template():
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
  assert tokenizer_lib.gemma_turns(messages) == (
      "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
      "<start_of_turn>model\nHello<end_of_turn>\n"
      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
  assert tokenizer_lib.gemma_turns([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=False) == \
      "<start_of_turn>user\nHi<end_of_turn>\n"


def test_chat_picks_the_vocabulary_s_markup(tok):
  messages = [{"role": "user", "content": "Hi"}]
  assert tok.chat(messages) == tok.chatml(messages)
