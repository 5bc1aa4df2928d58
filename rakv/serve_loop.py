"""The engine thread of ``rakv.serve``: one thread owns the ``BatchEngine`` (which is not
thread-safe) and the HTTP handlers, on the event loop, talk to it through a command queue.

The thread loops: it drains the command queue (submit, abort), runs one ``step`` if the
engine has work, and hands each event to its request's asyncio queue with
``loop.call_soon_threadsafe``. With no work it blocks on the command queue: no spin.

Invariants:
- every engine call is made on the engine thread;
- a request's queue gets ``Accepted`` or ``Rejected`` first, then its token events in
  order; it ends with a finished event or ``Failed``, and nothing follows either;
- a request whose stream is closed before its finish (the client went away, a stop
  string matched) is aborted in the engine, so its rows are freed at the next step;
- an exception in ``step`` (or anywhere in the loop) fails the requests in the engine
  with a server error, logs its traceback once, and the thread goes on serving: the
  engine state of a request caught in a failed step is unknown, and the contract names no
  way to tell which requests a step ran, so every request in the engine is failed.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from rakv.engine import RequestError
from rakv.serve_metrics import ServeMetrics

log = logging.getLogger("rakv.serve")


class EngineFailure(RuntimeError):
    """The engine failed while running a request (a server error); the message is one line."""


@dataclass(frozen=True)
class Accepted:
    request_id: int


@dataclass(frozen=True)
class Rejected:
    message: str  # the engine's RequestError: the request's fault


@dataclass(frozen=True)
class Failed:
    message: str  # the engine's fault


@dataclass(frozen=True)
class _Submit:
    stream: RequestStream
    prompt_ids: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class _Abort:
    stream: RequestStream


_STOP = object()


class RequestStream:
    """One request, as its HTTP handler sees it (used on the event loop's thread only, but
    for ``_engine_id`` and ``_last_token_s``, which only the engine thread touches)."""

    def __init__(self, owner: EngineLoop, arrival_s: float):
        self._owner = owner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival_s = arrival_s  # time.perf_counter() when the handler got the request
        self.request_id: int | None = None
        self.done = False  # finished, failed or closed: nothing more will come
        self._engine_id: int | None = None
        self._last_token_s: float | None = None

    async def events(self) -> AsyncIterator:
        """The request's TokenEvents up to its finished one; ``EngineFailure`` if it failed."""
        while not self.done:
            item = await self.queue.get()
            if isinstance(item, Failed):
                self.done = True
                raise EngineFailure(item.message)
            self.done = item.finished
            yield item

    def close(self) -> None:
        """Give the request up: aborted in the engine unless it is done. Never blocks."""
        if not self.done:
            self.done = True
            self._owner._commands.put(_Abort(self))


class EngineLoop:
    """The engine thread around ``engine`` (a ``BatchEngine`` or anything with its methods)."""

    def __init__(self, engine):
        self.engine = engine
        self.pair = engine.pair
        self.metrics = ServeMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, RequestStream] = {}  # engine thread only: request id -> its stream
        self._thread = threading.Thread(target=self._run, name="rakv-engine", daemon=True)

    # -- the event loop's side -------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread after the step in progress; requests still running fail."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, arrival_s: float) -> RequestStream:
        """The request's stream once the engine took it; ``RequestError`` if it refused it
        (the request's fault), ``EngineFailure`` if it failed. Cancelled while waiting (the
        client went away), the request is aborted."""
        if not self.alive:
            raise EngineFailure("the engine thread is not running")
        stream = RequestStream(self, arrival_s)
        self._commands.put(_Submit(stream, list(prompt_ids), max_new_tokens))
        try:
            item = await stream.queue.get()
        except BaseException:
            stream.close()
            raise
        if isinstance(item, Rejected):
            stream.done = True
            raise RequestError(item.message)
        if isinstance(item, Failed):
            stream.done = True
            raise EngineFailure(item.message)
        stream.request_id = item.request_id
        return stream

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        wedged = False  # a failure left the engine with work but no requests: wait for a command
        while True:
            try:
                busy = self.engine.has_work() and not wedged
                commands = self._drain(block=not busy)
                if _STOP in commands:
                    self._shut_down(commands)
                    return
                for command in commands:
                    wedged = False
                    self._command(command)
                events = self.engine.step() if self.engine.has_work() else []
                # before the events go out: a client that saw its finish sees it counted
                self.metrics.engine_stats(self.engine.stats())
                self._dispatch(events)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any engine error
                log.exception("engine step failed; failing the %d request(s) in the engine", len(self._live))
                self._fail_all(_engine_failed(exc))
                wedged = self._has_work_safely()

    def _drain(self, block: bool) -> list:
        """The commands queued now; when ``block``, at least one (waiting for it)."""
        commands = [self._commands.get()] if block else []
        try:
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _command(self, command) -> None:
        stream = command.stream
        if isinstance(command, _Abort):
            if stream._engine_id is not None and self._live.pop(stream._engine_id, None) is not None:
                self.engine.abort(stream._engine_id)
                self.metrics.aborted()
            return
        try:
            request_id = self.engine.submit(command.prompt_ids, command.max_new_tokens, arrival_s=stream.arrival_s)
        except RequestError as exc:
            self._post(stream, Rejected(_first_line(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the engine's fault: this request fails, the others run on
            log.exception("engine submit failed")
            self._post(stream, Failed(_engine_failed(exc)))
            self.metrics.failed(1)
            return
        stream._engine_id = request_id
        self._live[request_id] = stream
        self._post(stream, Accepted(request_id))

    def _dispatch(self, events) -> None:
        now = time.perf_counter()
        for event in events:
            stream = self._live.get(event.request_id)
            if stream is None:  # aborted after the step was planned
                continue
            if event.token_ids:
                if stream._last_token_s is None:
                    self.metrics.first_token(now - stream.arrival_s)
                else:
                    self.metrics.later_tokens(now - stream._last_token_s, len(event.token_ids))
                stream._last_token_s = now
            if event.finished:
                del self._live[event.request_id]
            self._post(stream, event)

    def _post(self, stream: RequestStream, item) -> None:
        """Hand ``item`` to the stream's event loop; a loop that is gone drops the request."""
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: no one is listening any more
            request_id = stream._engine_id
            if request_id is not None and self._live.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def _shut_down(self, commands: list) -> None:
        """Fail every request, running or still to be submitted: nothing will run them."""
        self._fail_all("the server is shutting down")
        for command in commands:
            if isinstance(command, _Submit):
                self._post(command.stream, Failed("the server is shutting down"))

    def _fail_all(self, message: str) -> None:
        live, self._live = self._live, {}
        for request_id, stream in live.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already broken; the request fails anyway
                pass
            self._post(stream, Failed(message))
        self.metrics.failed(len(live))

    def _has_work_safely(self) -> bool:
        try:
            return self.engine.has_work()
        except Exception:  # noqa: BLE001 - a broken engine: wait for the next command before trying again
            return True


def _engine_failed(exc: BaseException) -> str:
    """What a request the engine failed is told (one line)."""
    return f"the engine failed: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
