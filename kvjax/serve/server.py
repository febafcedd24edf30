"""An OpenAI-compatible HTTP server over one ``Engine``.

  engine = Engine(lm, policy="snapkv", budget=512, kv_memory="1GiB", max_slots=8)
  loop = EngineLoop(engine)
  app = create_app(loop, model_name="smollm2")  # uvicorn.run(app); or python -m kvjax.serve

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

The engine runs in a thread of its own (``EngineLoop``, kvjax/serve/loop.py);
the routes submit to it and await each request's tokens. Text streams as it
becomes final (whole characters, nothing that could begin a stop string). A
client that goes away cancels its request, so its pages go back at once. Bad
requests get HTTP 400 with OpenAI's error body, and nothing in the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import secrets
import time
import uuid
from typing import Any, AsyncIterator

import fastapi
import pydantic
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from kvjax.serve.loop import RATE_WINDOW_S, EngineError, EngineLoop, Handle
from kvjax.serve.requests import Completion

__all__ = ["EngineError", "EngineLoop", "create_app"]

DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is there


# -------------------------------------------------------------------- text as it grows

class _TextStream:
  """A request's text as its tokens arrive, sent only where it is final.

  The whole text is decoded each time (a token may complete a character the
  previous one began) and only its new suffix is sent. A trailing U+FFFD (a
  character still incomplete) is held back, and so is a tail that could begin
  a stop string: the engine cuts the text before a stop string, so none of it
  may go out.
  """

  def __init__(self, tokenizer, stop: tuple[str, ...]):
    self._decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
    self._stop, self._tokens, self._sent = stop, [], ""

  def add(self, ids: list[int]) -> str:
    self._tokens += ids
    return self._advance(_settled(self._decode(self._tokens), self._stop))

  def finish(self, text: str) -> str:
    """The rest of the completion's (final) text."""
    new, self._sent = text[len(self._sent):], text
    return new

  def _advance(self, text: str) -> str:
    if len(text) <= len(self._sent) or not text.startswith(self._sent):
      return ""
    new, self._sent = text[len(self._sent):], text
    return new


def _settled(text: str, stop: tuple[str, ...]) -> str:
  """The part of ``text`` that stays whatever tokens follow."""
  text = text.rstrip("\ufffd")
  for s in stop:
    if s in text:
      text = text[:text.index(s)]
  hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
  return text[:len(text) - hold]


# -------------------------------------------------------------------- the HTTP side

class BadRequest(Exception):
  """A request the server refuses: HTTP 400, the error body naming ``param``."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


class _Params(pydantic.BaseModel):
  """What both completion routes take; of the other fields, ``_UNSERVED`` are refused
  unless left at their defaults, the rest (``user``, ...) ignored."""

  model_config = pydantic.ConfigDict(extra="allow")

  model: str | None = None
  max_tokens: pydantic.StrictInt | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: pydantic.StrictInt | None = None  # not OpenAI's: vLLM's extension (0 or -1: all)
  seed: pydantic.StrictInt | None = None
  stop: str | list[str] | None = None
  n: pydantic.StrictInt | None = None
  stream: pydantic.StrictBool = False
  stream_options: dict[str, Any] | None = None


class CompletionRequest(_Params):
  prompt: str | list[pydantic.StrictInt] | list[str] | list[list[pydantic.StrictInt]]


class _Part(pydantic.BaseModel):
  type: str
  text: str | None = None


class _Message(pydantic.BaseModel):
  role: str
  content: str | list[_Part]


class ChatRequest(_Params):
  messages: list[_Message]
  max_completion_tokens: pydantic.StrictInt | None = None


# OpenAI's fields the server does not honour, with the values that ask for nothing.
_UNSERVED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
             "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
             "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
             "tools": (None, []), "response_format": (None, {"type": "text"})}
# The names an engine's ValueError may start with, for the error body's "param".
_PARAMS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "stop", "message", "messages")


class _Api:
  """The routes, over one loop and model name."""

  def __init__(self, loop: EngineLoop, model_name: str):
    self.loop, self.model_name = loop, model_name
    self.tokenizer = loop.engine.lm.tokenizer

  async def completions(self, body: CompletionRequest, request: fastapi.Request):
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise BadRequest("a batch of prompts is not served: send one prompt per request",
                         "prompt")
      prompt = prompt[0]
    sampling = self._sampling(body, body.max_tokens)
    handle = await self._submit("prompt", prompt=prompt, **sampling)
    reply = _Reply("cmpl", "text_completion", self.model_name, chat=False)
    return await self._answer(handle, reply, body, sampling["stop"], request)

  async def chat(self, body: ChatRequest, request: fastapi.Request):
    messages = [{"role": m.role, "content": _content(m.content, i)}
                for i, m in enumerate(body.messages)]
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    sampling = self._sampling(body, max_tokens)
    handle = await self._submit("messages", messages=messages, **sampling)
    reply = _Reply("chatcmpl", "chat.completion", self.model_name, chat=True)
    return await self._answer(handle, reply, body, sampling["stop"], request)

  async def models(self):
    return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                        "created": 0, "owned_by": "kvjax"}]}

  async def health(self):
    if self.loop.error:
      return responses.JSONResponse({"status": "error", "message": self.loop.error}, 503)
    return {"status": "ok"}

  def _sampling(self, body: _Params, max_tokens: int | None) -> dict:
    """The engine's keywords for the request's sampling fields (BadRequest for the unserved)."""
    if body.model is not None and body.model != self.model_name:
      raise BadRequest(f"model {body.model!r} is not served here; this server serves "
                       f"{self.model_name!r}", "model")
    if body.n not in (None, 1):
      raise BadRequest(f"n must be 1 (one choice per request), got {body.n}", "n")
    if body.top_p not in (None, 1.0):
      raise BadRequest(f"top_p must be 1 (nucleus sampling is not served), got {body.top_p}",
                       "top_p")
    for name, value in (body.model_extra or {}).items():
      if name in _UNSERVED and value not in _UNSERVED[name]:
        raise BadRequest(f"{name} is not served; leave it out", name)
    kwargs = dict(max_tokens=max_tokens, stop=(body.stop,) if isinstance(body.stop, str)
                  else tuple(body.stop or ()),
                  temperature=1.0 if body.temperature is None else body.temperature,
                  # OpenAI's draws differ from one request to the next unless seeded.
                  seed=secrets.randbelow(2 ** 32) if body.seed is None else body.seed,
                  top_k=0 if body.top_k in (None, -1) else body.top_k)  # vLLM's -1: all
    return kwargs

  async def _submit(self, prompt_param: str, **kwargs) -> Handle:
    try:
      return await self.loop.submit(**kwargs)
    except ValueError as e:
      words = re.findall(r"[a-z_]+", str(e)[:20])
      param = words[0] if words and words[0] in _PARAMS else None
      raise BadRequest(str(e), prompt_param if param in ("prompt", "message") else param) from None

  async def _answer(self, handle: Handle, reply: _Reply, body: _Params, stop, request):
    text = _TextStream(self.tokenizer, stop)
    if body.stream:
      usage = bool((body.stream_options or {}).get("include_usage"))
      return responses.StreamingResponse(self._events(handle, reply, text, usage),
                                         media_type="text/event-stream")
    completion = await self._wait(handle, request)
    if completion is None:  # the client left; its request is cancelled
      return responses.Response(status_code=499)
    return reply.whole(completion)

  async def _wait(self, handle: Handle, request: fastapi.Request) -> Completion | None:
    """The completion, or None once the client has gone (its request then cancelled)."""
    while True:
      item = await _next(handle.events, DISCONNECT_POLL_S)
      if isinstance(item, Completion):
        return item
      if isinstance(item, EngineError):
        raise item
      if item is None and await request.is_disconnected():
        self.loop.cancel(handle.id)
        return None

  async def _events(self, handle: Handle, reply: _Reply, text: _TextStream,
                    usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the chunks, then [DONE]. Leaving early (the client went away:
    Starlette cancels this) cancels the request."""
    ended = False
    try:
      if reply.chat:
        yield _sse(reply.chunk("", first=True))
      while True:
        item = await handle.events.get()
        if isinstance(item, EngineError):
          ended = True
          yield _sse(_error_body(str(item), "server_error"))
          break
        if isinstance(item, Completion):
          ended = True
          yield _sse(reply.chunk(text.finish(item.text), item.finish_reason))
          if usage:
            yield _sse(reply.usage_chunk(item))
          break
        new = text.add(item)
        if new:
          yield _sse(reply.chunk(new))
      yield "data: [DONE]\n\n"
    finally:
      if not ended:
        self.loop.cancel(handle.id)


async def _next(events: asyncio.Queue, timeout: float):
  """The next event, or None after ``timeout`` (no event lost: the get is not cut short)."""
  getter = asyncio.ensure_future(events.get())
  done, _ = await asyncio.wait({getter}, timeout=timeout)
  if done:
    return getter.result()
  getter.cancel()
  return None


def _content(content, index: int) -> str:
  """A message's text: a string, or the text parts of a list joined by newlines."""
  if isinstance(content, str):
    return content
  if any(p.type != "text" or p.text is None for p in content):
    raise BadRequest(f"message {index}: only text content parts are served",
                     f"messages.{index}.content")
  return "\n".join(p.text for p in content)


@dataclasses.dataclass
class _Reply:
  """OpenAI's wire format for one request: the whole answer, or its stream's chunks."""

  prefix: str
  kind: str  # "text_completion" or "chat.completion"
  model: str
  chat: bool

  def __post_init__(self):
    self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

  def _head(self, kind: str) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

  def whole(self, c: Completion) -> dict:
    part = ({"message": {"role": "assistant", "content": c.text}} if self.chat
            else {"text": c.text})
    choice = {"index": 0, **part, "logprobs": None, "finish_reason": c.finish_reason}
    return {**self._head(self.kind), "choices": [choice], "usage": _usage(c)}

  def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict:
    """A stream's chunk of new text; a chat's ``first`` chunk names the role."""
    if self.chat:
      delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
      part = {"delta": delta}
    else:
      part = {"text": text}
    choice = {"index": 0, **part, "logprobs": None, "finish_reason": finish_reason}
    return {**self._head(self.chunk_kind), "choices": [choice]}

  def usage_chunk(self, c: Completion) -> dict:
    """The stream's last chunk when the client asked for usage (stream_options)."""
    return {**self._head(self.chunk_kind), "choices": [], "usage": _usage(c)}

  @property
  def chunk_kind(self) -> str:
    return "chat.completion.chunk" if self.chat else self.kind


def _usage(c: Completion) -> dict:
  return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
          "total_tokens": c.prompt_tokens + len(c.token_ids)}


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_body(message: str, kind: str = "invalid_request_error",
                param: str | None = None) -> dict:
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# -------------------------------------------------------------------- the app

def create_app(loop: EngineLoop, *, model_name: str) -> fastapi.FastAPI:
  """The server's routes over ``loop``; its lifespan starts the loop and drains it at shutdown.

  /metrics reads a registry of the app's own (never prometheus_client's global one).
  """

  @contextlib.asynccontextmanager
  async def lifespan(_):
    loop.start()
    yield
    await asyncio.to_thread(loop.stop, drain=True)  # uvicorn has closed every connection

  app = fastapi.FastAPI(title="kvjax", lifespan=lifespan)
  api = _Api(loop, model_name)
  app.add_api_route("/v1/completions", api.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
  app.add_api_route("/v1/models", api.models, methods=["GET"])
  app.add_api_route("/health", api.health, methods=["GET"])
  registry = CollectorRegistry()
  registry.register(_Metrics(loop))

  async def metrics():
    return responses.Response(exposition.generate_latest(registry),
                              media_type=exposition.CONTENT_TYPE_LATEST)

  app.add_api_route("/metrics", metrics, methods=["GET"])
  _add_error_handlers(app)
  return app


def _add_error_handlers(app: fastapi.FastAPI) -> None:
  """Errors in OpenAI's body; a bad request is a 400 (FastAPI's would be 422), never logged."""

  def answer(status: int, message: str, param: str | None = None, kind=None):
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return responses.JSONResponse(_error_body(message, kind, param), status)

  @app.exception_handler(RequestValidationError)
  async def invalid(_, e: RequestValidationError):
    error = (e.errors() or [{"loc": (), "msg": "invalid request"}])[0]
    if error.get("type") == "json_invalid":
      return answer(400, f"the request body is not valid JSON: {error.get('msg')}")
    # A union's errors name the member tried ("str", "list[int]"), not a field: the
    # first member's complaint ("should be a valid string") would mislead.
    loc = [str(p) for p in error.get("loc", ())[1:]]
    path = [p for p in loc if not ("[" in p or p in ("str", "int", "float"))]
    message = (f"wrong type ({type(error.get('input')).__name__})" if path != loc
               else error.get("msg", "invalid"))
    return answer(400, f"{'.'.join(path) or 'request body'}: {message}",
                  path[0] if path else None)

  @app.exception_handler(BadRequest)
  async def bad(_, e: BadRequest):
    return answer(400, str(e), e.param)

  @app.exception_handler(EngineError)
  async def failed(_, e: EngineError):
    return answer(e.status, str(e))

  @app.exception_handler(HTTPException)
  async def http(_, e: HTTPException):
    return answer(e.status_code, str(e.detail))


class _Metrics:
  """The loop's numbers as Prometheus metrics (a collector: read at each scrape)."""

  GAUGES = (("kvjax_requests_running", "Requests in a slot.", "running"),
            ("kvjax_requests_waiting", "Requests queued for a slot or pages.", "waiting"),
            ("kvjax_pages_in_use", "KV pages the running requests hold.", "pages_in_use"),
            ("kvjax_pages", "KV pages in the pool.", "pages"),
            ("kvjax_generation_tokens_per_second",
             f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", "tokens_per_s"))
  COUNTERS = (("kvjax_requests_finished", "Requests that ended (stop or length).", "finished"),
              ("kvjax_generated_tokens", "Tokens generated.", "tokens"),
              ("kvjax_preemptions", "Requests preempted (recomputed later).", "preemptions"))

  def __init__(self, loop: EngineLoop):
    self.loop = loop

  def collect(self):
    numbers = self.loop.snapshot()
    for name, doc, key in self.GAUGES:
      yield GaugeMetricFamily(name, doc, value=numbers[key])
    for name, doc, key in self.COUNTERS:
      yield CounterMetricFamily(name, doc, value=numbers[key])
