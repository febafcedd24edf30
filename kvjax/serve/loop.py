"""The engine in a thread of its own, fed and read from asyncio code.

  loop = EngineLoop(engine)
  loop.start()
  handle = await loop.submit(prompt="Hello", max_tokens=16)  # ValueError for a bad value
  while not isinstance(item := await handle.events.get(), (Completion, EngineError)):
    print(item)  # the token ids generated since the last step

``Engine`` is not thread-safe: only the loop's thread touches it. Submissions
and cancellations reach it through a queue that the thread drains before every
``engine.step()``; after each step it hands every live request its new tokens,
and each ended one its ``Completion``, through the request's asyncio queue.
An idle loop sleeps on its queue (a bounded wait), it never spins.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time

from kvjax.serve.engine import Engine
from kvjax.serve.requests import Completion

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle loop sleeps on its queue: the latency of a new request
RATE_WINDOW_S = 10.0  # the tokens/s gauge's sliding window


class EngineError(Exception):
  """The engine failed (500) or no longer takes requests (503)."""

  def __init__(self, message: str, status: int = 500):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class Handle:
  """A submitted request: its engine id and what the engine thread sends it.

  ``events`` receives lists of new token ids, then the ``Completion``, or an
  ``EngineError`` instead.
  """

  id: int
  events: asyncio.Queue


@dataclasses.dataclass
class _Live:
  """A running request as the engine thread sees it."""

  loop: asyncio.AbstractEventLoop
  events: asyncio.Queue
  sent: int = 0  # tokens already sent (tokens_of shrinks while a preempted request recomputes)


class EngineLoop:
  """Runs ``engine`` in a thread of its own; ``submit`` and ``cancel`` from asyncio code."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.error: str | None = None  # why the loop failed; new requests then get 503
    self._commands: queue.Queue = queue.Queue()
    self._live: dict[int, _Live] = {}  # touched by the engine thread only
    self._lock = threading.Lock()  # orders a submission against the loop's closing
    self._closed, self._drain = False, True
    self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
    self._finished = 0
    self._samples: collections.deque = collections.deque()  # (time, tokens) for tokens/s
    self._snapshot = self._measure()

  def start(self) -> None:
    """Starts the engine thread (once; later calls do nothing)."""
    with self._lock:
      if not self._thread.is_alive() and not self._closed:
        self._thread.start()

  async def submit(self, **kwargs) -> Handle:
    """Queues ``engine.submit(**kwargs)``; returns once the engine took it.

    Raises:
      ValueError: the engine refused a value (the caller answers 400).
      EngineError: the loop is stopped or failed.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    live = _Live(asyncio.get_running_loop(), asyncio.Queue())
    with self._lock:
      if self._closed:
        raise EngineError(self.error or "the server is shutting down", 503)
      self._commands.put(("submit", kwargs, future, live))
    try:
      request_id = await asyncio.wrap_future(future)
    except asyncio.CancelledError:  # the caller left: a request the engine took must end
      future.add_done_callback(self._cancel_taken)
      raise
    return Handle(request_id, live.events)

  def cancel(self, request_id: int) -> None:
    """Ends a request (its pages go back before the next step); thread-safe."""
    self._commands.put(("cancel", request_id))

  def stop(self, drain: bool = True, timeout: float | None = None) -> None:
    """Takes no more requests, finishes what runs (``drain``) or cancels it, and waits."""
    with self._lock:
      self._closed, self._drain = True, drain
      started = self._thread.is_alive()
    self._commands.put(None)  # wakes an idle loop
    if started:
      self._thread.join(timeout)

  def snapshot(self) -> dict[str, float]:
    """The engine's numbers after its last step (read by /metrics from any thread)."""
    return self._snapshot

  def _cancel_taken(self, future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
      self.cancel(future.result())

  # ---------------------------------------------------------------- the engine thread

  def _run(self) -> None:
    try:
      while True:
        self._take_commands(wait=not self.engine.has_work)
        if self._closed and not (self._drain and self.engine.has_work):
          break
        if self.engine.has_work:
          self._publish(self.engine.step())
        self._snapshot = self._measure()
    except Exception as e:  # pylint: disable=broad-except
      logger.exception("the engine failed; failing its requests")  # once, with the traceback
      self.error = f"the engine failed: {type(e).__name__}: {e}"
    self._close()

  def _take_commands(self, wait: bool) -> None:
    """Handles the queued commands; when idle, sleeps on the queue (a bounded wait) first."""
    try:
      command = self._commands.get(timeout=IDLE_WAIT_S) if wait else self._commands.get_nowait()
      while True:
        self._handle(command)
        command = self._commands.get_nowait()
    except queue.Empty:
      pass

  def _handle(self, command) -> None:
    if command is None:
      return
    if command[0] == "cancel":
      if self._live.pop(command[1], None) is not None:
        self.engine.cancel(command[1])
      return
    _, kwargs, future, live = command
    if not future.set_running_or_notify_cancel():
      return  # the caller left before the engine saw it
    try:
      request_id = self.engine.submit(**kwargs)
    except ValueError as e:  # a bad value: the caller's 400, nothing logged
      future.set_exception(e)
      return
    except Exception as e:  # pylint: disable=broad-except
      logger.exception("engine.submit failed")
      future.set_exception(EngineError(f"{type(e).__name__}: {e}"))
      return
    self._live[request_id] = live
    future.set_result(request_id)

  def _publish(self, done: list[Completion]) -> None:
    """Sends each live request its new tokens, and each ended one its completion."""
    for completion in done:
      self._finished += 1
      live = self._live.pop(completion.id, None)
      if live is not None:
        self._send(completion.id, live, completion)
    for request_id, live in list(self._live.items()):
      tokens = self.engine.tokens_of(request_id) or []
      if len(tokens) > live.sent:
        self._send(request_id, live, list(tokens[live.sent:]))
        live.sent = len(tokens)

  def _send(self, request_id: int, live: _Live, item) -> None:
    if not _notify(live, item) and self._live.pop(request_id, None) is not None:
      self.engine.cancel(request_id)  # nobody waits for it

  def _close(self) -> None:
    """Refuses new requests; fails the queued and running ones (none left after a drain)."""
    with self._lock:
      self._closed = True
    failure = EngineError(self.error or "the server is shutting down", 500 if self.error else 503)
    while True:
      try:
        command = self._commands.get_nowait()
      except queue.Empty:
        break
      if command and command[0] == "submit" and command[2].set_running_or_notify_cancel():
        command[2].set_exception(failure)
    for live in self._live.values():
      _notify(live, failure)  # (a failed engine is not asked to cancel)
    self._live.clear()
    with contextlib.suppress(Exception):  # a failed engine may not answer
      self._snapshot = self._measure()

  def _measure(self) -> dict[str, float]:
    engine, now = self.engine, time.monotonic()
    tokens = engine.stats["tokens"]
    self._samples.append((now, tokens))
    while now - self._samples[0][0] > RATE_WINDOW_S:
      self._samples.popleft()
    then, before = self._samples[0]
    return {"running": engine.running, "waiting": engine.waiting,
            "pages_in_use": engine.pages_in_use, "pages": engine.num_pages,
            "finished": self._finished, "tokens": tokens,
            "preemptions": engine.stats["preemptions"],
            "tokens_per_s": (tokens - before) / (now - then) if now > then else 0.0}


def _notify(live: _Live, item) -> bool:
  """Puts ``item`` on the request's queue, from the engine thread; False if its event
  loop is closed."""
  try:
    live.loop.call_soon_threadsafe(live.events.put_nowait, item)
  except RuntimeError:
    return False
  return True
