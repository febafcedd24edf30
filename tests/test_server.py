"""The HTTP server: OpenAI's own client against kvjax.serve.server over a small engine.

One server for the module (uvicorn in a thread, on a free port of 127.0.0.1);
every wait is bounded, so a broken server fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

import kvjax
from kvjax import policies
from kvjax.serve import Engine
from kvjax.serve import server as server_lib
from kvjax.serve.loop import EngineError, EngineLoop

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "smollm2-test"
BUDGET = 64
SIZES = dict(max_slots=4, max_prompt_tokens=256, max_tokens=32, prefill_chunk=128, page_size=16,
             steps_per_dispatch=4, backend="xla")
# Over the budget (so SnapKV evicts) and under one prefill chunk.
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
          "the wick, polished the great lens and wrote the weather in his log: wind from the "
          "west, a heavy swell, rain before midnight. Ships passed far out, their lights "
          "small and steady. The keeper had lived alone on the island for eleven years, "
          "with a cat, a shelf of books and a radio that only caught the fishing forecast. "
          "One night a boat came close to the rocks, and")
STORY = "Once upon a time"
TIMEOUT_S = 120  # one request, compiled programs


def _policy():
  return policies.get("snapkv", **policies.window_fields("snapkv", 16))


@pytest.fixture(scope="module")
def engine(smollm2_lm):
  probe = Engine(smollm2_lm, policy=_policy(), budget=BUDGET, kv_memory="64MiB", **SIZES)
  pages = SIZES["max_slots"] * probe.pages_for(probe.max_prompt, SIZES["max_tokens"])
  return Engine(smollm2_lm, policy=_policy(), budget=BUDGET, num_pages=pages, **SIZES)


def _until(condition, timeout: float, what: str) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    time.sleep(0.02)


@contextlib.contextmanager
def _running(app):
  """Serves ``app`` with uvicorn in a thread on a free port; yields its base URL."""
  # log_config=None: uvicorn's records reach the root logger (caplog) and it leaves the
  # process's logging set-up alone.
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="info",
                                         log_config=None))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  _until(lambda: server.started or not thread.is_alive(), 60, "the server to start")
  assert server.started
  try:
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(60)
  assert not thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="module")
def served(engine):
  """The app on uvicorn in a thread; its programs compiled by a first request."""
  loop = EngineLoop(engine)
  with _running(server_lib.create_app(loop, model_name=MODEL)) as base:
    warm = httpx.post(f"{base}/v1/completions", json={"prompt": STORY, "max_tokens": 2},
                      timeout=600)
    assert warm.status_code == 200, warm.text
    yield types.SimpleNamespace(base=base, loop=loop, engine=engine)


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0,
                       timeout=TIMEOUT_S)


def _generate(lm, engine, prompt, **kw):
  # The engine's programs generate its max_tokens; a request keeps the first of them.
  return kvjax.generate(lm, [prompt], policy=_policy(), budget=BUDGET,
                        max_new_tokens=engine.max_tokens, prefill_chunk=engine.chunk,
                        page_size=SIZES["page_size"], backend="xla", **kw)


def _idle(engine) -> bool:
  return engine.running == engine.waiting == engine.pages_in_use == 0


# ---------------------------------------------------------------- answers

def test_a_greedy_completion_is_generates(client, served, smollm2_lm):
  want = _generate(smollm2_lm, served.engine, PROMPT)
  ids = smollm2_lm.tokenizer.encode(PROMPT, add_bos=None)
  assert len(ids) > BUDGET  # SnapKV evicts
  for prompt in (PROMPT, ids):  # a string, or its token ids
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=SIZES["max_tokens"],
                                    temperature=0)
    assert got.choices[0].text == want.texts[0]
    assert got.usage.completion_tokens == len(want.token_ids[0])
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.total_tokens == len(ids) + len(want.token_ids[0])
  stopped = want.token_ids[0][-1] in smollm2_lm.tokenizer.stop_ids
  assert got.choices[0].finish_reason == ("stop" if stopped else "length")
  assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")


def test_a_chat_completion_renders_the_chat_template(client, served, smollm2_lm):
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
  tokenizer = smollm2_lm.tokenizer
  rendered = tokenizer.apply_chat_template(messages)
  assert got.usage.prompt_tokens == len(tokenizer.encode(rendered, add_bos=None))
  want = _generate(smollm2_lm, served.engine, messages[0]["content"], chat_template=True)
  assert got.choices[0].message.content == want.texts[0]
  assert got.choices[0].message.role == "assistant"
  assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")


def _stream_lines(base: str, route: str, body: dict) -> list[str]:
  with httpx.stream("POST", f"{base}{route}", json={**body, "stream": True},
                    timeout=TIMEOUT_S) as response:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    return [line for line in response.iter_lines() if line]


def test_streamed_chunks_add_up_to_the_answer(client, served):
  body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
  whole = client.completions.create(**body).choices[0]
  lines = _stream_lines(served.base, "/v1/completions", body)
  assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
  chunks = [json.loads(line[6:]) for line in lines[:-1]]
  assert {c["object"] for c in chunks} == {"text_completion"} and len(chunks) > 2
  assert "".join(c["choices"][0]["text"] for c in chunks) == whole.text
  assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole.finish_reason
  # A stop string in the middle: the stream holds back what could begin it.
  stop = whole.text[len(whole.text) // 2:][:6]
  cut = client.completions.create(**body, stop=[stop]).choices[0]
  assert cut.text == whole.text[:whole.text.index(stop)] and cut.finish_reason == "stop"
  pieces = [c.choices[0].text for c in client.completions.create(**body, stop=stop, stream=True)]
  assert "".join(pieces) == cut.text


def test_a_streamed_chat_adds_up_and_reports_usage(client):
  body = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
              max_tokens=12, temperature=0)
  whole = client.chat.completions.create(**body)
  chunks = list(client.chat.completions.create(
      **body, stream=True, stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == whole.choices[0].message.content
  assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_concurrent_requests_each_get_their_own_answer(client):
  prompts = [PROMPT, STORY, "def fibonacci(n):"]

  def ask(prompt):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                     temperature=0).choices[0].text

  want = {p: ask(p) for p in prompts}
  asked = prompts * 2  # more requests than slots: some wait
  with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
    got = list(pool.map(ask, asked))
  assert got == [want[p] for p in asked]


def test_sampled_requests_follow_their_seed(client):
  def sample(seed):
    return client.completions.create(model=MODEL, prompt=STORY, max_tokens=12, temperature=1.0,
                                     seed=seed, extra_body={"top_k": 40}).choices[0].text
  assert sample(3) == sample(3)


# ---------------------------------------------------------------- the other routes

def test_models_and_health(client, served):
  assert [m.id for m in client.models.list().data] == [MODEL]
  health = httpx.get(f"{served.base}/health", timeout=10)
  assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_metrics_report_the_pool_and_the_work_done(client, served):
  client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0)
  _until(lambda: _idle(served.engine), 30, "the engine to go idle")
  text = httpx.get(f"{served.base}/metrics", timeout=10).text
  samples = {s.name: s.value for family in parser.text_string_to_metric_families(text)
             for s in family.samples}
  assert samples["kvjax_pages"] == served.engine.num_pages
  assert samples["kvjax_pages_in_use"] == samples["kvjax_requests_running"] == 0
  assert samples["kvjax_requests_waiting"] == 0
  assert samples["kvjax_requests_finished_total"] >= 1
  assert samples["kvjax_generated_tokens_total"] >= 4
  assert samples["kvjax_preemptions_total"] >= 0
  assert samples["kvjax_generation_tokens_per_second"] >= 0


# ---------------------------------------------------------------- bad requests

LONG = " ".join(["word"] * 400)  # over max_prompt_tokens


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"prompt": STORY, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": STORY, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": STORY, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": STORY, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": STORY, "n": 2}, "n"),
    ("/v1/completions", {"prompt": STORY, "top_p": 0.5}, "top_p"),
    ("/v1/completions", {"prompt": STORY, "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": STORY, "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": STORY, "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
])
def test_a_bad_request_gets_400_and_an_error_body(served, caplog, route, body, param):
  caplog.set_level(logging.INFO)
  response = httpx.post(f"{served.base}{route}", json=body, timeout=TIMEOUT_S)
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert error["type"] == "invalid_request_error" and error["param"] == param
  assert error["code"] is None and error["message"] and "Traceback" not in error["message"]
  assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]


def test_the_server_serves_on_after_bad_requests(client, served):
  for body in ({}, {"prompt": STORY, "max_tokens": -3}):
    assert httpx.post(f"{served.base}/v1/completions", json=body, timeout=10).status_code == 400
  bad_json = httpx.post(f"{served.base}/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"}, timeout=10)
  assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] is None
  with pytest.raises(openai.BadRequestError) as info:
    client.completions.create(model=MODEL, prompt=STORY, n=3)
  assert info.value.status_code == 400 and info.value.body["param"] == "n"
  got = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0)
  assert got.usage.completion_tokens == 3
  _until(lambda: _idle(served.engine), 30, "the engine to go idle")


# ---------------------------------------------------------------- clients that leave

def test_a_client_that_leaves_mid_stream_cancels_its_request(client, served, monkeypatch):
  engine = served.engine
  cancelled = []
  cancel = engine.cancel

  def spy(request_id):
    cancelled.append(cancel(request_id))
    return cancelled[-1]

  monkeypatch.setattr(engine, "cancel", spy)
  stream = client.completions.create(model=MODEL, prompt=STORY, max_tokens=engine.max_tokens,
                                     temperature=0, stream=True)
  first = next(iter(stream))
  assert first.choices[0].finish_reason is None
  stream.close()
  _until(lambda: True in cancelled, 30, "the engine to cancel the request")
  _until(lambda: _idle(engine), 30, "the pages to come back")
  assert int(engine.cache.num_free) == engine.num_pages


# ---------------------------------------------------------------- the loop alone

class _FailingEngine:
  """Takes requests; its step raises, as a broken device would."""

  lm = types.SimpleNamespace(tokenizer=None)
  running = waiting = pages_in_use = 0
  num_pages = 10

  def __init__(self):
    self.stats, self.queued = {"tokens": 0, "preemptions": 0}, []

  @property
  def has_work(self):
    return bool(self.queued)

  def submit(self, prompt=None, **kwargs):
    if kwargs.get("max_tokens") == 0:
      raise ValueError("max_tokens must be an int in [1, 8], got 0")
    self.queued.append(prompt)
    return len(self.queued) - 1

  def step(self):
    raise RuntimeError("the device fell over")


def test_an_engine_failure_fails_its_requests_with_500_not_a_hang(caplog):
  loop = EngineLoop(_FailingEngine())
  loop.start()

  async def ask():
    with pytest.raises(ValueError, match="max_tokens"):
      await asyncio.wait_for(loop.submit(prompt=[1], max_tokens=0), 10)
    handle = await asyncio.wait_for(loop.submit(prompt=[1, 2]), 10)
    return await asyncio.wait_for(handle.events.get(), 10)

  with caplog.at_level(logging.ERROR):
    failure = asyncio.run(ask())
  assert isinstance(failure, EngineError) and failure.status == 500
  assert "the device fell over" in str(failure)
  assert [r.message for r in caplog.records].count("the engine failed; failing its requests") == 1

  async def later():
    return await asyncio.wait_for(loop.submit(prompt=[3]), 10)

  with pytest.raises(EngineError) as info:
    asyncio.run(later())
  assert info.value.status == 503
  loop.stop(timeout=10)


def test_an_engine_failure_is_a_500_body_and_health_says_so():
  app = server_lib.create_app(EngineLoop(_FailingEngine()), model_name=MODEL)
  with _running(app) as base, httpx.Client(base_url=base, timeout=30) as http:
    response = http.post("/v1/completions", json={"prompt": [1, 2]})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "the device fell over" in error["message"]
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert http.post("/v1/completions", json={"prompt": [1]}).status_code == 503


def test_text_streams_whole_characters_and_holds_back_stop_strings(smollm2_lm):
  tokenizer = smollm2_lm.tokenizer
  text = "Un café, s'il vous plaît: 東京 🙂 done"
  ids = tokenizer.encode(text)
  stream = server_lib._TextStream(tokenizer, ("STOP",))  # pylint: disable=protected-access
  pieces = [stream.add([t]) for t in ids]
  assert "".join(pieces) == tokenizer.decode(ids) and not any("\ufffd" in p for p in pieces)
  settled = server_lib._settled  # pylint: disable=protected-access
  assert settled("Hello ST", ("STOP",)) == "Hello "
  assert settled("Hello STOP and more", ("STOP",)) == "Hello "
  assert settled("Hello S", ("STOP", "Sx")) == "Hello "
  assert settled("Hello", ("STOP",)) == "Hello"


# ---------------------------------------------------------------- the command line

def _serve(*args: str, **kw) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "kvjax.serve", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, **kw)


@pytest.mark.parametrize("args, words", [
    (["--port=70000"], "--port must be in [0, 65535]"),
    (["--kv_memory=lots"], "kv_memory"),
    (["--policy=nope"], "--policy 'nope' is not one of"),
    (["--mesh=model:64"], "--mesh model:64"),
    (["--max_slots=many"], "max_slots"),
])
def test_a_bad_flag_is_one_line_and_exit_2(args, words):
  done = _serve(*args, timeout=120)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert lines[-1].startswith("error: ") and words in lines[-1], lines
  assert "Traceback" not in done.stderr


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_lets_the_open_request_finish(smollm2_path):
  port = _free_port()
  process = subprocess.Popen(
      [sys.executable, "-m", "kvjax.serve", f"--model={smollm2_path}", "--policy=full",
       "--budget=0", "--num_pages=4000", "--max_slots=2", "--max_prompt_tokens=128",
       "--max_tokens=48", "--prefill_chunk=128", "--backend=xla", f"--port={port}",
       "--log_level=warning"], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
      stderr=subprocess.PIPE, text=True)
  try:
    base = f"http://127.0.0.1:{port}"

    def up():
      assert process.poll() is None, process.stderr.read()
      try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
      except httpx.TransportError:
        return False

    _until(up, 300, "the server to come up")
    body = {"prompt": STORY, "max_tokens": 48, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
      lines = response.iter_lines()
      assert next(line for line in lines if line).startswith("data: {")
      process.send_signal(signal.SIGTERM)
      rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    # uvicorn ends by raising the signal again, once the app has shut down.
    assert process.wait(120) in (0, -signal.SIGTERM)
    assert "Traceback" not in process.stderr.read()
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(30)
