"""An OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m rakv.serve                                   # smollm2 at http://127.0.0.1:8000/v1
    python -m rakv.serve --pair qwen-coder --policy learned --port 8001 --api-key KEY

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``:
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, ``rakv.serve_metrics``).

Greedy only (``rakv.serve_api``): every completion is token-identical to plain greedy
decoding of the target, whatever else the server runs beside it. One engine thread owns
the engine (``rakv.serve_loop``); a client that goes away before its request finishes,
streamed or not, has the request aborted so that its rows are freed at the next step.
Every error is OpenAI's JSON error body with a one-line message; a malformed body is a
400 (not FastAPI's 422).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rakv.calibrate import RECALIBRATE_HELP
from rakv.cli import add_pair_arguments, run_cli
from rakv.engine import RequestError
from rakv.models import PairError
from rakv.scheduler import ITL_TARGET_HELP, MAX_NUM_PREFILLS_HELP, TTFT_TARGET_HELP, BatchConfig
from rakv.serve_api import (ApiError, ChatRequest, CompletionRequest, Decoding, OutputText, Shape, chat_prompt_ids,
                            check_request, prompt_ids, usage)
from rakv.serve_loop import EngineFailure, EngineLoop, RequestStream
from rakv.serve_metrics import render

CLIENT_GONE = 499  # nginx's status for a client that closed the connection; no one reads it


@dataclass(frozen=True)
class Piece:
    """A step of a response: text that became final, the token ids the step gave, and the
    finish reason on the last piece."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


def create_app(engine_loop: EngineLoop, api_key: str | None = None) -> FastAPI:
    """The server's routes around a started ``EngineLoop``; with ``api_key``, every route but
    ``/health`` needs ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="rakv", docs_url=None, redoc_url=None, openapi_url=None)
    pair = engine_loop.pair
    created = int(time.time())
    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return JSONResponse(_validation_error(exc).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # Starlette logs the traceback after this
        message = f"internal error: {type(exc).__name__}: {(str(exc).strip() or '-').splitlines()[0]}"
        return JSONResponse(ApiError(500, message, kind="server_error").body(), 500)

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse(ApiError(503, "the engine thread is not running", kind="server_error").body(), 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": pair.name, "object": "model", "created": created,
                                            "owned_by": "rakv", "max_model_len": pair.max_positions}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render(engine_loop.metrics.snapshot()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        decoding = check_request(body, pair.name)
        ids = prompt_ids(body.prompt, pair)
        shape = Shape(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), pair.name, decoding.return_token_ids)
        return await _respond(engine_loop, request, ids, decoding, shape, arrival_s)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        arrival_s = time.perf_counter()
        decoding = check_request(body, pair.name)
        ids = chat_prompt_ids(body.messages, pair)
        shape = Shape(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), pair.name, decoding.return_token_ids)
        return await _respond(engine_loop, request, ids, decoding, shape, arrival_s)

    return app


async def _respond(engine_loop: EngineLoop, request: Request, ids: list[int], decoding: Decoding, shape: Shape,
                   arrival_s: float):
    pair = engine_loop.pair
    # no max_tokens (chat): as many as the context allows; the engine clips any request to it
    max_new = decoding.max_new_tokens or max(1, pair.max_positions - len(ids))
    try:
        stream = await engine_loop.submit(ids, max_new, arrival_s)
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None
    except EngineFailure as exc:
        raise ApiError(500, str(exc), kind="server_error") from None
    text = OutputText(pair.decode, pair.eos_token_ids, decoding.stop)
    if decoding.stream:
        return StreamingResponse(_events(stream, text, shape, decoding, len(ids)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    work = asyncio.ensure_future(_collect(stream, text))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        work.cancel()  # a no-op once it is done; else the client went away: the request is aborted
    if not work.done() or work.cancelled():
        return Response(status_code=CLIENT_GONE)
    try:
        finish_reason = work.result()
    except EngineFailure as exc:
        raise ApiError(500, str(exc), kind="server_error") from None
    return shape.response(text.text, text.token_ids, finish_reason, usage(len(ids), len(text.token_ids)))


async def _pieces(stream: RequestStream, text: OutputText):
    """The response's pieces as the engine gives tokens; the request is aborted if the
    consumer stops early (a stop string, a client gone)."""
    try:
        async for event in stream.events():
            if event.token_ids:
                piece = text.add(event.token_ids)
                if text.stopped:
                    yield Piece(piece, tuple(event.token_ids), "stop")
                    return
                yield Piece(piece, tuple(event.token_ids))
            if event.finished:
                yield Piece(text.finish(), (), "stop" if text.ended_by_eos else "length")
    finally:
        stream.close()


async def _collect(stream: RequestStream, text: OutputText) -> str:
    """Run the request to its end (``text`` then holds it); its finish reason."""
    finish_reason = "length"
    async with aclosing(_pieces(stream, text)) as pieces:
        async for piece in pieces:
            finish_reason = piece.finish_reason or finish_reason
    return finish_reason


async def _events(stream: RequestStream, text: OutputText, shape: Shape, decoding: Decoding, num_prompt: int):
    """The server-sent events of a streamed response. A chunk goes out when text became
    final, when the step gave token ids the client asked for, and at the finish. A client
    that disconnects cancels this generator (Starlette), which aborts the request."""
    try:
        if shape.chat:
            yield _sse(shape.chunk("", (), role=True))
        async with aclosing(_pieces(stream, text)) as pieces:
            async for piece in pieces:
                if piece.text or piece.finish_reason or (shape.token_ids and piece.token_ids):
                    yield _sse(shape.chunk(piece.text or (None if shape.chat else ""), piece.token_ids,
                                           piece.finish_reason))
        if decoding.include_usage:
            yield _sse(shape.usage_chunk(usage(num_prompt, len(text.token_ids))))
    except EngineFailure as exc:  # the status line is sent already: the error goes in the stream
        yield _sse(ApiError(500, str(exc), kind="server_error").body())
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its body already read, the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's validation error as OpenAI's 400: the first problem, naming its field."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
    path = [str(part) for part in error["loc"][1:]]  # loc[0] is "body"
    if not path:
        return ApiError(400, f"the body must be a JSON object: {error['msg']}")
    return ApiError(400, f"{'.'.join(path)}: {error['msg']}", path[0])


class _ApiKey:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streams and hide
    disconnects): 401 without the key, on every route but /health."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            error = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                             code="invalid_api_key")
            await JSONResponse(error.body(), 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# -- command line ----------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = BatchConfig()
    p = argparse.ArgumentParser(
        prog="python -m rakv.serve",
        description="An OpenAI-compatible server (completions, chat completions, streaming) with continuous "
                    "batching, exact KV reuse and speculative decoding; greedy only: every output is "
                    "token-identical to plain greedy decoding of the target.")
    add_pair_arguments(p, default_pair="smollm2")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0: a free one (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: none)")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                   help=f"requests running at once at most (default: {defaults.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                   help=f"rows of one batched step at most (default: {defaults.max_num_batched_tokens})")
    p.add_argument("--max-num-prefills", type=int, default=defaults.max_num_prefills,
                   help=f"{MAX_NUM_PREFILLS_HELP} (default: {defaults.max_num_prefills})")
    p.add_argument("--memory-budget-mib", type=float, default=defaults.memory_budget_bytes / 2**20,
                   help="running requests' KV plus the prefix store "
                        f"(default: {defaults.memory_budget_bytes / 2**20:g} MiB)")
    p.add_argument("--itl-target", type=float, default=None, metavar="S", help=f"{ITL_TARGET_HELP} (default: none)")
    p.add_argument("--ttft-target", type=float, default=None, metavar="S",
                   help=f"{TTFT_TARGET_HELP} (default: none, first come first served)")
    p.add_argument("--recalibrate", action="store_true", help=RECALIBRATE_HELP)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Fail before any model loads (ValueError, one line)."""
    for option in ("max_num_seqs", "max_num_batched_tokens", "max_num_prefills"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    for option in ("memory_budget_mib", "store_budget_mib", "itl_target", "ttft_target"):
        if getattr(args, option) is not None and getattr(args, option) <= 0:
            raise ValueError(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}")
    from rakv.policies import check_policy
    check_policy(args.policy, args.pair)


def build_engine(args: argparse.Namespace):
    """The BatchEngine the arguments describe: the pair, policy and store as
    ``rakv.generate`` loads them."""
    from rakv.batch_engine import BatchEngine
    from rakv.calibrate import load_or_calibrate
    from rakv.choices import fixed_action
    from rakv.controller import ControllerConfig
    from rakv.models import load_pair
    from rakv.policies import resolve_policy
    from rakv.settings import EngineConfig
    from rakv.store_model import StoreConfig

    pair = load_pair(args.pair, None, args.max_context, args.draft_layers, args.linear_kernels, args.weights)
    timings = load_or_calibrate(pair, refresh=args.recalibrate) if fixed_action(args.policy) is None else None
    policy = resolve_policy(args.policy, timings, ControllerConfig(store_drafter=not args.no_store_drafter),
                            pair.target_fingerprint, pair.draft_fingerprint, args.pair, args.strict)
    config = EngineConfig(StoreConfig(int(args.store_budget_mib * 2**20), args.store))
    batch = BatchConfig(args.max_num_seqs, args.max_num_batched_tokens, int(args.memory_budget_mib * 2**20),
                        args.itl_target, args.ttft_target, args.max_num_prefills)
    return BatchEngine(pair, policy, config, batch, timings=timings)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    check_args(args)
    try:  # listen before loading the models: a port in use fails in a second, not after a load
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    try:
        engine = build_engine(args)
        engine_loop = EngineLoop(engine).start()
        try:
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
            pair = engine.pair
            print(f"serving {pair.name} (weights {pair.weights}, policy {engine.policy.name}) at "
                  f"http://{host}:{port}/v1", flush=True)
            config = uvicorn.Config(create_app(engine_loop, args.api_key), log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=5)
            server = uvicorn.Server(config)
            server.run(sockets=[sock])
            # uvicorn shuts down on Ctrl-C and raises the signal again for the default
            # handler, but asyncio.run's own SIGINT handler can take it after the server's
            # task has finished, and then nothing is raised (a fresh clone's suite once saw
            # status 0): a Ctrl-C the server took is an interrupt, status 130 (run_cli)
            if signal.SIGINT in getattr(server, "_captured_signals", ()):
                raise KeyboardInterrupt
        finally:
            engine_loop.stop()
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, PairError, RequestError, OSError))


if __name__ == "__main__":
    sys.exit(main())
