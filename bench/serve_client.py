"""The client side of ``python -m bench.serve``: streamed completions through the official
``openai`` client, sent at seeded arrival times or with a fixed number in flight.

Each request is ``completions.create(..., temperature=0, stream=True,
stream_options={"include_usage": True})``: greedy, so two runs of one prompt on an exact
server give the same text. The clock starts just before the call and each streamed chunk
is timed as the client receives it (``bench.serve_stats`` turns the times into TTFT, ITL
and e2e). The client never retries (a retry would hide a failure inside a latency); a
request that fails, or runs past ``timeout_s``, is recorded as failed with its one-line
reason and the run goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass

from bench.serve_stats import RequestRecord, failed_record, inter_token_latencies, split_tokens
from bench.serve_workload import Prompt


class ServeError(OSError):
    """A server that cannot be benchmarked (down, no model, failed warm-up); one line."""


@dataclass(frozen=True)
class Server:
    """A server under test: its name in the table, its OpenAI base URL (ending in ``/v1``)
    and the model name sent with every request."""

    name: str
    base_url: str
    model: str


def make_client(base_url: str, api_key: str, timeout_s: float):
    """An ``AsyncOpenAI`` client that never retries (a retried request would count its
    failures' time as latency) and opens a connection per request: reusing one races the
    server's closing it (llama-server dropped about one request in 20 with "Server
    disconnected without sending a response"), and every request then pays the same
    connect (well under a millisecond on 127.0.0.1). No cap on connections: a burst is
    sent at once, not queued inside the client where its wait would be hidden."""
    import httpx
    import openai
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s, http_client=http)


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception and of its causes (the openai client wraps the
    transport's error, which says what happened, in a bare "Connection error."); a cause
    that repeats its wrapper's words (httpx re-raising httpcore's error) is left out."""
    parts: list[str] = []
    last = None
    while exc is not None and len(parts) < 4:  # bounded: a cause chain can be long
        text = str(exc).strip().splitlines()
        message = text[0][:200] if text else ""
        if message != last:
            parts.append(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
        last, exc = message, exc.__cause__
    return " (".join(parts) + ")" * (len(parts) - 1)


async def resolve_model(client, name: str, base_url: str, model: str | None) -> str:
    """``model``, or the first model the server lists at ``GET /models``; a server that does
    not answer is a ``ServeError`` (checked even when ``model`` is given)."""
    import openai
    try:
        page = await client.models.list()
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise ServeError(f"server {name} at {base_url} is not reachable ({one_line(cause)})") from None
    except openai.OpenAIError as exc:  # an error status, or an answer that is not a model list
        if model:
            return model
        raise ServeError(f"server {name} at {base_url}: GET /models failed ({one_line(exc)}); "
                         f"give the model's name with --model") from None
    if model:
        return model
    if not page.data:
        raise ServeError(f"server {name} at {base_url} lists no model; give one with --model")
    return page.data[0].id


async def stream_one(client, model: str, prompt: str, max_tokens: int, index: int, run_start: float,
                     timeout_s: float, return_token_ids: bool) -> RequestRecord:
    """One streamed request, timed from just before the call; failures become a record."""
    sent = time.perf_counter()
    try:
        return await asyncio.wait_for(
            _stream(client, model, prompt, max_tokens, index, run_start, sent, return_token_ids), timeout_s)
    except asyncio.TimeoutError:
        return failed_record(index, sent - run_start, f"timed out after {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - any failure of one request is that request's, not the run's
        return failed_record(index, sent - run_start, one_line(exc))


async def _stream(client, model, prompt, max_tokens, index, run_start, sent, return_token_ids) -> RequestRecord:
    extra = {"extra_body": {"return_token_ids": True}} if return_token_ids else {}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, **extra)
    times: list[float] = []
    chars: list[int] = []
    ids: list[list[int] | None] = []
    text: list[str] = []
    usage_tokens = None
    try:
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                usage_tokens = int(chunk.usage.completion_tokens)
            for choice in chunk.choices[:1]:  # n = 1
                piece = choice.text or ""
                # vLLM's name; a server that streams each chunk's ids (rakv's, say) may use it
                chunk_ids = getattr(choice, "token_ids", None)
                chunk_ids = list(chunk_ids) if isinstance(chunk_ids, list) else None
                if piece or chunk_ids:
                    times.append(now)
                    chars.append(len(piece))
                    ids.append(chunk_ids)
                    text.append(piece)
    finally:
        await stream.close()
    end = time.perf_counter()
    every_chunk_has_ids = bool(ids) and all(i is not None for i in ids)
    if every_chunk_has_ids:
        per_chunk, source = [len(i) for i in ids], "token_ids"
    elif usage_tokens is not None:
        per_chunk, source = split_tokens(chars, usage_tokens), "usage"
    else:
        per_chunk, source = [1] * len(times), "chunks"
    output_tokens = usage_tokens if usage_tokens is not None else sum(per_chunk)
    token_ids = tuple(t for i in ids for t in i) if every_chunk_has_ids else None
    return RequestRecord(index=index, sent_s=sent - run_start, ttft_s=times[0] - sent if times else None,
                         e2e_s=end - sent, itl_s=inter_token_latencies(times, per_chunk), output_tokens=output_tokens,
                         tokens_from=source, text="".join(text), token_ids=token_ids)


@dataclass(frozen=True)
class RunResult:
    """A run's records in prompt order and the most requests the client had in flight."""

    records: tuple[RequestRecord, ...]
    max_in_flight: int


async def run_load(client, model: str, prompts: tuple[Prompt, ...], *, arrivals_s: tuple[float, ...] | None = None,
                   concurrency: int | None = None, timeout_s: float = 600.0, return_token_ids: bool = False,
                   desc: str = "requests") -> RunResult:
    """Every prompt once: each sent at its arrival time (``arrivals_s``, from the run's
    start) or, with ``concurrency``, as soon as one of that many slots is free, in order.
    A continuing prompt waits for its earlier turn first (holding no slot), then is sent
    with that turn's prompt and output before its own text; if the earlier turn failed,
    so does it. Bounded: every request ends within ``timeout_s`` of being sent."""
    from tqdm import tqdm
    if (arrivals_s is None) == (concurrency is None):
        raise ValueError("give exactly one of arrivals_s and concurrency")
    start = time.perf_counter()
    finished = {p.index: asyncio.Event() for p in prompts}
    records: dict[int, RequestRecord] = {}
    sent_text: dict[int, str] = {}
    slots = asyncio.Semaphore(concurrency) if concurrency is not None else contextlib.nullcontext()
    flight = {"now": 0, "max": 0}
    bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, leave=False)

    async def one(position: int, prompt: Prompt) -> None:
        if arrivals_s is not None:
            await asyncio.sleep(max(0.0, start + arrivals_s[position] - time.perf_counter()))
        text = prompt.text
        if prompt.continues is not None:
            await finished[prompt.continues].wait()
            earlier = records[prompt.continues]
            if not earlier.ok:
                records[prompt.index] = failed_record(prompt.index, time.perf_counter() - start,
                                                      f"its earlier turn (prompt {prompt.continues}) failed")
                finished[prompt.index].set()
                bar.update()
                return
            text = sent_text[prompt.continues] + earlier.text + prompt.text
        sent_text[prompt.index] = text
        async with slots:
            flight["now"] += 1
            flight["max"] = max(flight["max"], flight["now"])
            try:
                records[prompt.index] = await stream_one(client, model, text, prompt.max_tokens, prompt.index,
                                                         start, timeout_s, return_token_ids)
            finally:
                flight["now"] -= 1
        finished[prompt.index].set()
        bar.update()

    try:
        await asyncio.gather(*(one(position, prompt) for position, prompt in enumerate(prompts)))
    finally:
        bar.close()
    return RunResult(tuple(records[p.index] for p in prompts), flight["max"])


async def warm_up(client, server: Server, prompts: tuple[Prompt, ...], count: int, timeout_s: float) -> None:
    """``count`` untimed requests, one at a time, from the prompts that stand alone; the
    first failure is a ``ServeError`` (a server that cannot answer is not benchmarked)."""
    alone = [p for p in prompts if p.continues is None]
    for i in range(count):
        prompt = alone[i % len(alone)]
        record = await stream_one(client, server.model, prompt.text, prompt.max_tokens, prompt.index,
                                  time.perf_counter(), timeout_s, False)
        if not record.ok:
            raise ServeError(f"server {server.name} at {server.base_url} failed its warm-up request: {record.error}")
