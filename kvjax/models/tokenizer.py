"""Text <-> token ids, and chat prompts, for the models kvjax loads.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer`. It is built either
from GGUF metadata (vocabulary, merges, token types and special ids stored in
the file) or from a `tokenizer.json` of a Hugging Face checkpoint folder; a
folder with only a SentencePiece `tokenizer.model` is read with `sentencepiece`
(`kvjax.models.sentencepiece_backend`).

A GGUF "llama" tokenizer (Gemma's) is a SentencePiece BPE model stored as
pieces, scores and types: two adjacent pieces merge, highest-scoring merged
piece first, and characters outside the vocabulary fall back to byte pieces.
It becomes a `tokenizers` BPE with one merge per way of splitting each piece
into two pieces, ranked by the piece's score (as transformers converts a
SentencePiece BPE model), control and user-defined pieces as added tokens
matched whole in the text (as llama.cpp does). transformers' own GGUF reader
makes a Unigram model of those scores instead, which splits words into more
pieces than the model was trained on ("▁world" as "▁w", "or", "ld").

GGUF byte-level BPE tokenizers name their pre-tokenizer in `tokenizer.ggml.pre`
(llama.cpp's list of regexes). Each supported name maps to the equivalent
`tokenizers` pre-tokenizer, so ids equal those of the original Hugging Face
tokenizer.json the GGUF was converted from.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kvjax.models.gguf_loader import GGUFMetadata, GGUFTokenizerData, read_gguf_metadata
from kvjax.models.sentencepiece_backend import SentencePieceBackend

# llama.cpp token types (enum llama_token_type).
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Tokens that end an assistant turn in the chat formats kvjax knows; when one is
# a special token of the vocabulary, generation stops on it as on EOS.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<eos>")

# Pre-tokenizer regexes of llama.cpp (llama-vocab.cpp), as used by the Hugging
# Face tokenizer.json files those GGUFs were converted from.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
  # add_prefix_space=False: these vocabularies never glue a space to the start.
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False)


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
  """The `tokenizers` pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre`."""
  if pre in (None, "", "default", "gpt-2", "gpt2"):
    return _byte_level(use_regex=True)
  if pre in ("smollm", "starcoder", "refact"):
    # llama.cpp splits every digit off ("\p{N}") before the GPT-2 regex, as the
    # original tokenizer.json's Digits(individual_digits) pre-tokenizer does.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    _byte_level(use_regex=True)])
  if pre in ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"):
    return pre_tokenizers.Sequence([_split(_LLAMA3_REGEX), _byte_level(use_regex=False)])
  if pre in ("qwen2", "deepseek-r1-qwen"):
    return pre_tokenizers.Sequence([_split(_QWEN2_REGEX), _byte_level(use_regex=False)])
  raise ValueError(
      f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: "
      "smollm, starcoder, refact, gpt-2, llama-bpe, qwen2")


def _sentencepiece_bpe(data: GGUFTokenizerData) -> tokenizers.Tokenizer:
  """The `tokenizers` BPE equivalent of a GGUF "llama" (SentencePiece BPE) vocabulary."""
  tokens, scores = data.tokens, data.scores
  if not tokens or len(scores) != len(tokens):
    raise ValueError(f"GGUF metadata has {len(tokens)} tokenizer.ggml.tokens and "
                     f"{len(scores)} tokenizer.ggml.scores; a SentencePiece vocabulary "
                     "needs a score per token")
  if data.add_space_prefix:
    raise ValueError("GGUF SentencePiece tokenizers with tokenizer.ggml.add_space_prefix "
                     "true (Llama 2, Mistral) are not supported; Gemma's has false")
  types = data.token_types or (_TOKEN_TYPE_NORMAL,) * len(tokens)
  vocab = {token: i for i, token in enumerate(tokens)}
  ranked = []  # (piece score, piece id, left, right)
  for i, (piece, kind) in enumerate(zip(tokens, types)):
    if kind != _TOKEN_TYPE_NORMAL:  # SentencePiece merges into normal pieces only
      continue
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in vocab and right in vocab:
        ranked.append((-scores[i], i, vocab[left], left, right))
  ranked.sort()
  merges = [(left, right) for *_, left, right in ranked]
  unk = data.unk_id if data.unk_id is not None else 0
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                            unk_token=tokens[unk], fuse_unk=True))
  backend.normalizer = normalizers.Replace(" ", "\u2581")
  backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse()])
  _add_typed_tokens(backend, tokens, types)
  return backend


def _add_typed_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str],
                      types: Sequence[int]) -> None:
  """Control tokens (<|im_start|>, <start_of_turn>...) are matched whole in text and
  dropped when decoding with skip_special_tokens; user-defined ones are only matched."""
  backend.add_special_tokens([
      tokenizers.AddedToken(t, special=True, normalized=False)
      for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_CONTROL])
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_USER_DEFINED]
  if user:
    backend.add_tokens(user)


def _token_content(value: Any) -> str | None:
  """A special token from tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value


def _compile_template(source: Any, origin: str) -> jinja2.Template:
  """The jinja template of ``source``; a ValueError naming ``origin`` if it does not compile."""
  if not isinstance(source, str):
    raise ValueError(f"the chat template of {origin} is not a string: {type(source).__name__}")
  try:
    return _template_environment().from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f"the chat template of {origin} does not compile: {e.message} "
                     f"(template line {e.lineno})") from None


def _template_environment() -> jinja2.Environment:
  # Same environment as transformers' apply_chat_template, so a template renders
  # to the same string: sandboxed, trim/lstrip blocks, loop controls, and the
  # helpers chat templates call.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _read_json_object(file: pathlib.Path) -> dict[str, Any]:
  """A JSON object file of a tokenizer's folder; {} when the file is absent."""
  if not file.is_file():
    return {}
  try:
    value = json.loads(file.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise ValueError(f"{file}: not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
  return value


def _folder_chat_template(folder: pathlib.Path, config: Mapping[str, Any]) -> tuple[Any, str]:
  """(chat template source or None, where it came from) of a Hugging Face tokenizer folder."""
  config_file = folder / "tokenizer_config.json"
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates; the default is for chat
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    template = named.get("default")
  if template is not None:
    return template, f"{config_file} (chat_template)"
  jinja_file = folder / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8", errors="replace"), str(jinja_file)
  return None, str(config_file)


def _generation_stop_ids(file: pathlib.Path) -> tuple[int, ...]:
  """generation_config.json's eos_token_id (an int or a list of ints) as a tuple."""
  ids = _read_json_object(file).get("eos_token_id")
  ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {ids!r}")
  return tuple(ids)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
        or not isinstance(message.get("content"), str):
      raise ValueError(
          f"message {i} must be a dict with string 'role' and 'content', got {message!r}")


def chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
  """Plain ChatML: each message as `<|im_start|>role\\ncontent<|im_end|>\\n`.

  Unlike SmolLM2's own template this adds no default system prompt when the
  conversation has none; small models follow a system-less prompt better on
  retrieval tasks (see DESIGN.md).
  """
  _check_messages(messages)
  parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
  if add_generation_prompt:
    parts.append("<|im_start|>assistant\n")
  return "".join(parts)


def gemma_turns(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
  """Gemma's turns: each message as `<start_of_turn>role\ncontent<end_of_turn>\n`.

  As Gemma's own template renders them: the assistant's role is "model", and a
  system message heads the first user turn (a blank line after it). No BOS:
  ``encode`` adds it where the tokenizer says so.
  """
  _check_messages(messages)
  messages = [dict(m) for m in messages]
  if messages and messages[0]["role"] == "system":
    system = messages.pop(0)["content"]
    if messages:
      messages[0]["content"] = f"{system}\n\n{messages[0]['content']}"
    else:
      messages = [dict(role="user", content=f"{system}\n\n")]
  role = {"assistant": "model"}
  parts = [f"<start_of_turn>{role.get(m['role'], m['role'])}\n{m['content']}<end_of_turn>\n"
           for m in messages]
  if add_generation_prompt:
    parts.append("<start_of_turn>model\n")
  return "".join(parts)


# Plain chat markups without a system prompt, by the token that opens a turn.
_TURN_FORMATS = (("<|im_start|>", chatml), ("<start_of_turn>", gemma_turns))


@dataclasses.dataclass(frozen=True)
class _Specials:
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  add_bos: bool
  chat_template: str | None
  extra_stop_ids: tuple[int, ...] = ()
  template_origin: str = "this tokenizer"  # where the chat template came from, for messages


class Tokenizer:
  """Encodes text to ids and back; renders chat prompts.

  Build it with `from_gguf`, `from_gguf_metadata` or `from_file`.
  """

  def __init__(self, backend: tokenizers.Tokenizer, specials: _Specials):
    self._backend = backend
    self._specials = specials
    # Compiled when a chat prompt is first asked for: a template that does not
    # compile costs only chat prompts, not the model's loading or plain text.
    self._template = None
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    ends = [specials.eos_id] + [backend.token_to_id(t) for t in _END_OF_TURN_TOKENS]
    ends = [i for i in ends if i is not None and (i == specials.eos_id or i in special)]
    ends += specials.extra_stop_ids
    self._stop_ids = tuple(dict.fromkeys(ends))  # ordered, eos first, no repeats

  # --- construction ---------------------------------------------------------

  @classmethod
  def from_gguf_metadata(cls, data: GGUFTokenizerData | GGUFMetadata) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file's `tokenizer.*` metadata."""
    origin = "GGUF metadata"
    if isinstance(data, GGUFMetadata):
      origin, data = data.path, data.tokenizer
    if data.model == "llama":
      backend = _sentencepiece_bpe(data)
    elif data.model != "gpt2":
      raise ValueError(
          f"GGUF tokenizer model {data.model!r} (tokenizer.ggml.model) is not supported; "
          "kvjax reads byte-level BPE ('gpt2') and SentencePiece BPE ('llama') tokenizers "
          "from GGUF")
    else:
      if not data.tokens or not data.merges:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
      vocab = {token: i for i, token in enumerate(data.tokens)}
      # A merge is "left right"; byte-level tokens never contain a plain space.
      merges = [tuple(m.split(" ", 1)) for m in data.merges]
      backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
      backend.pre_tokenizer = _gguf_pre_tokenizer(data.pre)
      backend.decoder = decoders.ByteLevel()
      _add_typed_tokens(backend, data.tokens, data.token_types or (1,) * len(data.tokens))
    return cls(backend, _Specials(bos_id=data.bos_id, eos_id=data.eos_id,
                                  pad_id=data.pad_id, add_bos=data.add_bos,
                                  chat_template=data.chat_template,
                                  template_origin=f"{origin} (tokenizer.chat_template)"))

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    """Reads only a GGUF file's metadata and builds its tokenizer."""
    return cls.from_gguf_metadata(read_gguf_metadata(path))

  @classmethod
  def from_file(cls, path: str | os.PathLike, chat_template: str | None = None) -> Tokenizer:
    """Builds from a Hugging Face `tokenizer.json` (or the folder holding it), or from
    a SentencePiece `tokenizer.model` (a folder with one and no `tokenizer.json`).

    Special tokens and the chat template come from `tokenizer_config.json` (or
    `chat_template.jinja`) beside it, extra stop ids from `generation_config.json`.
    """
    path = pathlib.Path(path)
    if path.is_dir():
      spm = path / "tokenizer.model"
      path = path / "tokenizer.json"
      if not path.is_file() and spm.is_file():
        path = spm
    if not path.is_file():
      raise ValueError(f"no tokenizer file at {path}")
    folder = path.parent
    if path.suffix == ".model":  # SentencePiece (Llama 2, Mistral, Gemma)
      backend = SentencePieceBackend(path)
    else:
      try:
        backend = tokenizers.Tokenizer.from_file(str(path))
      except Exception as e:  # tokenizers raises a bare Exception for any bad file
        raise ValueError(f"{path}: not a readable tokenizer.json: {e}") from None
    config_file = folder / "tokenizer_config.json"
    config = _read_json_object(config_file)

    def token_id(key):
      content = _token_content(config.get(key))
      if content is not None and not isinstance(content, str):
        raise ValueError(f"{config_file}: {key} must be a string or an object with a string "
                         f"'content', got {config.get(key)!r}")
      return backend.token_to_id(content) if content is not None else None

    origin = "the chat_template argument"
    if chat_template is None:
      chat_template, origin = _folder_chat_template(folder, config)
    extra = _generation_stop_ids(folder / "generation_config.json")
    # A SentencePiece model names its own; the config's names win.
    own = backend.special_ids() if isinstance(backend, SentencePieceBackend) else {}
    named = {k: token_id(f"{k}_token") for k in ("bos", "eos", "pad")}
    named = {k: v if v is not None else own.get(k) for k, v in named.items()}
    eos = named["eos"]
    if eos is None and extra:
      eos = extra[0]
    return cls(backend, _Specials(bos_id=named["bos"], eos_id=eos, pad_id=named["pad"],
                                  add_bos=bool(config.get("add_bos_token", False)),
                                  chat_template=chat_template, extra_stop_ids=extra,
                                  template_origin=origin))

  def save(self, folder: str | os.PathLike) -> None:
    """Writes what ``from_saved`` rebuilds this tokenizer from (the weight cache's copy)."""
    folder = pathlib.Path(folder)
    if isinstance(self._backend, SentencePieceBackend):
      (folder / "tokenizer.model").write_bytes(self._backend.processor.serialized_model_proto())
    else:
      self._backend.save(str(folder / "tokenizer.json"))
    (folder / "specials.json").write_text(json.dumps(dataclasses.asdict(self._specials)))

  @classmethod
  def from_saved(cls, folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer ``save`` wrote to ``folder``."""
    folder = pathlib.Path(folder)
    specials = json.loads((folder / "specials.json").read_text())
    specials["extra_stop_ids"] = tuple(specials["extra_stop_ids"])
    spm = folder / "tokenizer.model"
    backend = (SentencePieceBackend(spm) if spm.is_file()
               else tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")))
    return cls(backend, _Specials(**specials))

  # --- properties -----------------------------------------------------------

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._backend

  @property
  def bos_id(self) -> int | None:
    return self._specials.bos_id

  @property
  def eos_id(self) -> int | None:
    return self._specials.eos_id

  @property
  def pad_id(self) -> int | None:
    """Padding id; the EOS id when the model defines none."""
    pad = self._specials.pad_id
    return pad if pad is not None else self._specials.eos_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end generation: EOS first, then end-of-turn tokens such as <|im_end|>."""
    return self._stop_ids

  @property
  def add_bos(self) -> bool:
    """Whether the model expects BOS at the start of a prompt (False for SmolLM2)."""
    return self._specials.add_bos

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included."""
    return self._backend.get_vocab_size(with_added_tokens=True)

  @property
  def chat_template(self) -> str | None:
    return self._specials.chat_template

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._backend.id_to_token(token_id)

  # --- encoding -------------------------------------------------------------

  def _bos_prefix(self, add_bos: bool | None) -> list[int]:
    if add_bos is None:
      add_bos = self._specials.add_bos
    if not add_bos:
      return []
    if self.bos_id is None:
      raise ValueError("add_bos=True but this tokenizer has no BOS token")
    return [self.bos_id]

  def encode(self, text: str, add_bos: bool | None = False) -> list[int]:
    """Token ids of `text`; special tokens written in the text map to their ids.

    Args:
      text: the string to encode.
      add_bos: prepend BOS; None follows the model's own setting (`add_bos`).

    Returns:
      [T] ids.
    """
    ids = self._backend.encode(text, add_special_tokens=False).ids
    return self._bos_prefix(add_bos) + ids

  def encode_batch(self, texts: Sequence[str], add_bos: bool | None = False) -> list[list[int]]:
    """`encode` of each text, in parallel; ragged [B][T_b] ids."""
    prefix = self._bos_prefix(add_bos)
    encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
    return [prefix + e.ids for e in encodings]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of [T] ids; control tokens dropped when `skip_special_tokens`."""
    return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # --- chat -----------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders the model's own chat template, as transformers does.

    Note that SmolLM2's template inserts a default system prompt when the first
    message is not a system message; `chatml` does not.

    Args:
      messages: dicts with "role" and "content".
      add_generation_prompt: end with the header of an assistant turn.
      **kwargs: extra template variables (tools, documents, ...).

    Returns:
      The prompt text; encode it with `encode` (special tokens are recognized).

    Raises:
      ValueError: no chat template, one that does not compile (reported here,
        not when the model loads), or one that fails on these messages; the
        message names where the template came from.
    """
    if self._specials.chat_template in (None, ""):
      raise ValueError("this model ships no chat template; use chatml() or plain text")
    if self._template is None:
      self._template = _compile_template(self._specials.chat_template,
                                         self._specials.template_origin)
    _check_messages(messages)

    def token(token_id):
      return self.id_to_token(token_id) if token_id is not None else None

    variables = dict(bos_token=token(self.bos_id), eos_token=token(self.eos_id),
                     pad_token=token(self._specials.pad_id))
    variables.update(kwargs)
    try:
      return self._template.render(messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:  # raise_exception, sandbox refusals, ...
      raise ValueError(f"the chat template of {self._specials.template_origin} failed: "
                       f"{e}") from None

  def chatml(self, messages: Sequence[Mapping[str, Any]],
             add_generation_prompt: bool = True) -> str:
    """Plain ChatML without an injected system prompt; see module `chatml`."""
    if self.token_to_id("<|im_start|>") is None:
      raise ValueError("this vocabulary has no <|im_start|> token; ChatML does not apply")
    return chatml(messages, add_generation_prompt)

  @property
  def has_chat_template(self) -> bool:
    """Whether the model ships a chat template (an instruction-tuned model's does)."""
    return self._specials.chat_template not in (None, "")

  def chat(self, messages: Sequence[Mapping[str, Any]],
           add_generation_prompt: bool = True) -> str:
    """The vocabulary's own turn markup, without an injected system prompt: ChatML
    (SmolLM2, Qwen) where it has `<|im_start|>`, Gemma's turns where it has
    `<start_of_turn>`. What kvjax's tasks and CLIs put their prompts in.

    Raises:
      ValueError: a vocabulary with neither opening token.
    """
    for opener, render in _TURN_FORMATS:
      if self.token_to_id(opener) is not None:
        return render(messages, add_generation_prompt)
    raise ValueError("this vocabulary has neither <|im_start|> nor <start_of_turn>: kvjax "
                     "knows no chat markup for it; use apply_chat_template() or plain text")

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, stop_ids={self.stop_ids})")
