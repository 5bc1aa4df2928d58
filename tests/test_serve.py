"""The OpenAI-compatible server (rakv.serve): protocol and error shapes on a scripted fake
engine (in process, no socket), exact outputs and client disconnects on the tiny pair's
BatchEngine behind uvicorn on 127.0.0.1, driven by httpx and the official openai client,
and the command line."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from rakv.batch_engine import BatchConfig, BatchEngine, EngineStats, TokenEvent
from rakv.controller import make_policy
from rakv.engine import Engine, RequestError
from rakv.serve import create_app, main, parse_args
from rakv.serve_api import EMPTY_PROMPT, GREEDY_ONLY, OutputText, chat_prompt_ids
from rakv.serve_loop import EngineLoop
from rakv.tiny import EOS_ID, ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 30  # any single wait in these tests; far above what they take


# -- a scripted engine with BatchEngine's methods -------------------------------------------
class FakeEngine:
    """Byte tokens, one request's step at a time: a prompt's output is its script (a list of
    steps, each a tuple of tokens) if it has one, else letters; ``fail`` is a prompt text
    whose running makes ``step`` raise (once); ``step_delay_s`` slows every step."""

    def __init__(self, scripts: dict[str, list[tuple[int, ...]]] | None = None, fail: str | None = None,
                 step_delay_s: float = 0.0):
        tokenizer = ByteTokenizer()
        self.pair = SimpleNamespace(name="fake", tokenizer=tokenizer, encode=tokenizer.encode, decode=tokenizer.decode,
                                    eos_token_ids=frozenset({EOS_ID}), max_positions=64, weights="fp32",
                                    target=SimpleNamespace(config=SimpleNamespace(vocab_size=258)))
        self.scripts = {tuple(tokenizer.encode(text)): steps for text, steps in (scripts or {}).items()}
        self.fail = None if fail is None else tuple(tokenizer.encode(fail))
        self.step_delay_s = step_delay_s
        self.running: dict[int, dict] = {}
        self.aborted: list[int] = []
        self.next_id = 0

    def validate(self, prompt_ids, max_new_tokens):
        if not prompt_ids:
            raise RequestError("empty prompt: nothing to condition on")
        if len(prompt_ids) >= self.pair.max_positions:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate: "
                               f"the model's maximum is {self.pair.max_positions} positions")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return list(prompt_ids)

    def submit(self, prompt_ids, max_new_tokens, arrival_s=None):
        prompt = tuple(self.validate(prompt_ids, max_new_tokens))
        steps = self.scripts.get(prompt) or [(97 + (sum(prompt) + i) % 26,) for i in range(max_new_tokens)]
        self.next_id += 1
        self.running[self.next_id] = {"prompt": prompt, "steps": list(steps), "out": [], "max": max_new_tokens}
        return self.next_id

    def abort(self, request_id):
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_work(self):
        return bool(self.running)

    def step(self):
        time.sleep(self.step_delay_s)
        if self.fail is not None and any(r["prompt"] == self.fail for r in self.running.values()):
            self.fail = None
            raise RuntimeError("a scripted failure\nwith a second line")
        events = []
        for request_id, req in list(self.running.items()):
            tokens = req["steps"].pop(0)[:req["max"] - len(req["out"])]
            req["out"] += tokens
            events.append(TokenEvent(request_id, tokens, False))
            if not req["steps"] or len(req["out"]) >= req["max"] or req["out"][-1] == EOS_ID:
                del self.running[request_id]
                events.append(TokenEvent(request_id, (), True, SimpleNamespace(output_ids=tuple(req["out"]))))
        return events

    def stats(self):
        return EngineStats(len(self.running), 0, 1024, 2048, 0, 3, 5, 20, 4, 6, 0, 2)


def ascii_steps(text: str, per_step: int = 1) -> list[tuple[int, ...]]:
    data = list(text.encode())
    return [tuple(data[i:i + per_step]) for i in range(0, len(data), per_step)]


@contextlib.contextmanager
def started(engine, api_key: str | None = None):
    """An EngineLoop around ``engine`` and a TestClient on its app, stopped at the end."""
    loop = EngineLoop(engine).start()
    try:
        with TestClient(create_app(loop, api_key)) as client:
            yield client, loop
    finally:
        loop.stop()
        assert not loop.alive


@contextlib.contextmanager
def listening(engine):
    """The app around ``engine`` behind uvicorn on 127.0.0.1 (a free port); its base URL."""
    import uvicorn
    loop = EngineLoop(engine).start()
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(loop), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", loop
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
        loop.stop()


def sse_payloads(lines) -> list:
    """The JSON payloads of a server-sent event stream, then "[DONE]" (checked to be last)."""
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# -- protocol, on the fake engine ---------------------------------------------------------
def test_completion_streamed_and_not_agree_and_carry_usage_and_token_ids():
    engine = FakeEngine({"Say hi": ascii_steps("Hello there", 2)})
    with started(engine) as (client, _):
        body = {"model": "fake", "prompt": "Say hi", "max_tokens": 50, "return_token_ids": True}
        whole = client.post("/v1/completions", json=body).json()
        choice = whole["choices"][0]
        assert whole["object"] == "text_completion" and whole["model"] == "fake"
        assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
        assert choice["token_ids"] == list(b"Hello there")
        assert whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}

        with client.stream("POST", "/v1/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = sse_payloads(r.iter_lines())
        *token_chunks, last = chunks
        assert last["choices"] == [] and last["usage"] == whole["usage"]
        assert "".join(c["choices"][0]["text"] for c in token_chunks) == "Hello there"
        steps = [c["choices"][0]["token_ids"] for c in token_chunks[:-1]]
        assert steps == [list(s) for s in ascii_steps("Hello there", 2)]  # one chunk per step
        assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"

        # default max_tokens is OpenAI's 16; a prompt of token ids is taken as is
        plain = client.post("/v1/completions", json={"prompt": [256, 104, 105]}).json()["choices"][0]
        assert len(plain["text"]) == 16 and "token_ids" not in plain


def test_eos_ends_with_stop_and_is_not_in_the_text():
    engine = FakeEngine({"q": [(104,), (105, EOS_ID)]})
    with started(engine) as (client, _):
        r = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 9, "return_token_ids": True}).json()
    assert r["choices"][0]["text"] == "hi" and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["token_ids"] == [104, 105, EOS_ID] and r["usage"]["completion_tokens"] == 3


def test_chat_without_a_template_joins_roles_and_streams_deltas():
    tokenizer = ByteTokenizer()
    prompt = "system: be brief\nuser: hi\nassistant:"
    engine = FakeEngine({prompt: ascii_steps("Hi!")})
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with started(engine) as (client, _):
        whole = client.post("/v1/chat/completions", json={"messages": messages}).json()
        assert whole["object"] == "chat.completion"
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
        assert whole["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
        with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "stream": True}) as r:
            chunks = sse_payloads(r.iter_lines())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi!"
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_uses_the_tokenizers_template_where_it_has_one():
    seen = {}

    def apply_chat_template(messages, add_generation_prompt, tokenize):
        seen.update(messages=messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
        return {"input_ids": [1, 2, 3]}  # transformers 5: a BatchEncoding

    hf = SimpleNamespace(chat_template="{{ messages }}", apply_chat_template=apply_chat_template)
    pair = SimpleNamespace(tokenizer=SimpleNamespace(tokenizer=hf))
    from rakv.serve_api import ChatMessage
    ids = chat_prompt_ids([ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text",
                                                                                           "text": "b"}])], pair)
    assert ids == [1, 2, 3]
    assert seen == {"messages": [{"role": "user", "content": "ab"}], "add_generation_prompt": True, "tokenize": True}


def test_stop_strings_cut_the_text_hold_back_a_partial_match_and_abort():
    engine = FakeEngine({"p": ascii_steps("one, two. three. four")})
    with started(engine) as (client, _):
        r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 40, "stop": ["."]}).json()
        assert r["choices"][0]["text"] == "one, two" and r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == len("one, two.")
        wait_until(lambda: engine.aborted == [1], "the stopped request is aborted")
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "p", "max_tokens": 40, "stop": "three", "stream": True}) as s:
            texts = [c["choices"][0]["text"] for c in sse_payloads(s.iter_lines())]
    assert "".join(texts) == "one, two. "  # "t", "th", ... held back: the stream never took text back


def test_output_text_holds_back_incomplete_utf8_and_stop_prefixes():
    text = OutputText(ByteTokenizer().decode, {EOS_ID}, stop=("END",))
    pieces = [text.add([b]) for b in "aé EN".encode()] + [text.add([ord("d")]), text.finish()]
    assert "\ufffd" not in "".join(pieces) and pieces[1] == "" and pieces[2] == "é"
    assert pieces[4:6] == ["", ""]  # "E", "EN": maybe the start of END
    assert pieces[6] == "ENd" and "".join(pieces) == "aé ENd" and not text.stopped


def test_utf8_split_across_steps_streams_whole_characters():
    engine = FakeEngine({"u": [(97,), (0xC3,), (0xA9,), (98,)]})
    with started(engine) as (client, _):
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "u", "stream": True, "return_token_ids": True}) as r:
            choices = [c["choices"][0] for c in sse_payloads(r.iter_lines())]
    assert [(c["text"], c["token_ids"]) for c in choices[:4]] == [("a", [97]), ("", [0xC3]), ("é", [0xA9]),
                                                                   ("b", [98])]


def test_metrics_histograms_and_engine_gauges():
    engine = FakeEngine({"m": ascii_steps("abcdefg", 3)})  # steps of 3, 3, 1 tokens
    with started(engine) as (client, _):
        assert client.post("/v1/completions", json={"prompt": "m"}).status_code == 200
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "rakv_time_to_first_token_seconds_count") == 1
    assert metric(text, "rakv_inter_token_latency_seconds_count") == 4  # 3 + 1: the first step's are not gaps
    assert 'rakv_inter_token_latency_seconds_bucket{le="+Inf"} 4' in text
    assert metric(text, "rakv_kv_cache_bytes") == 1024 and metric(text, "rakv_prefix_store_bytes") == 2048
    assert metric(text, "rakv_prefix_hit_rate") == 0.25 and metric(text, "rakv_spec_accepted_tokens_per_round") == 1.5
    assert metric(text, "rakv_num_requests_running") == 0 and metric(text, "rakv_num_requests_waiting") == 0
    assert metric(text, "rakv_num_requests_waiting_late") == 0 and metric(text, "rakv_requests_late_total") == 2


def test_an_engine_failure_is_a_500_and_the_server_goes_on(caplog):
    engine = FakeEngine(fail="boom")
    with started(engine) as (client, loop):
        r = client.post("/v1/completions", json={"prompt": "boom"})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["message"] == "the engine failed: RuntimeError: a scripted failure"
        engine.fail = tuple(engine.pair.encode("boom"))
        with client.stream("POST", "/v1/completions", json={"prompt": "boom", "stream": True}) as s:
            chunks = sse_payloads(s.iter_lines())
        assert s.status_code == 200 and chunks[-1]["error"]["type"] == "server_error"
        assert client.post("/v1/completions", json={"prompt": "fine"}).status_code == 200
        assert loop.alive and metric(client.get("/metrics").text, "rakv_requests_failed_total") == 2
    assert sum("engine step failed" in r.message for r in caplog.records) == 2  # one traceback per failure


def test_a_failure_on_submit_is_a_500_not_a_hang():
    engine = FakeEngine()
    submit = engine.submit

    def broken(prompt_ids, max_new_tokens, arrival_s=None):
        engine.submit = submit  # once
        raise RuntimeError("a scripted submit failure")
    engine.submit = broken
    with started(engine) as (client, loop):
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "the engine failed: RuntimeError: a scripted submit failure"
        assert client.post("/v1/completions", json={"prompt": "fine"}).status_code == 200
        assert loop.alive and metric(client.get("/metrics").text, "rakv_requests_failed_total") == 1


def test_api_key_guards_every_route_but_health():
    with started(FakeEngine(), api_key="sesame") as (client, _):
        assert client.get("/health").json() == {"status": "ok"}
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            r = client.request(method, path, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["fake"]
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401


def test_a_non_streamed_request_whose_client_leaves_is_aborted():
    engine = FakeEngine(step_delay_s=0.01)
    with listening(engine) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": "slow", "max_tokens": 10_000}, timeout=0.3)
        wait_until(lambda: engine.aborted == [1], "the abandoned request is aborted")


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs is not supported by this server"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5},
     "presence_penalty is not supported: it would change the greedy output"),
    ("/v1/completions", {"prompt": [256, 300]}, "token id 300 is outside the vocabulary of 258"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request: a batch of prompts is not supported"),
    ("/v1/completions", {"prompt": {"text": "a"}}, "prompt must be a string or a list of token ids, got dict"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", ""]}, "stop strings must not be empty"),
    ("/v1/completions", {"prompt": "hi", "stream": "sometimes"}, "stream: Input should be a valid boolean"),
    ("/v1/completions", [1, 2], "the body must be a JSON object"),
    ("/v1/chat/completions", {"messages": []}, "messages must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens must be at least 1, got 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "only text content parts are supported"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role: Field required"),
])
def test_refusals_are_400s_in_openais_shape(path, body, message):
    with started(FakeEngine()) as (client, _):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_unknown_routes_and_methods_get_openais_error_body():
    with started(FakeEngine()) as (client, _):
        r = client.get("/v1/engines")
        assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found: GET /v1/engines"
        r = client.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed: GET /v1/completions"


# -- the tiny pair's BatchEngine ----------------------------------------------------------
class SlowBatchEngine(BatchEngine):
    """Steps no faster than ``step_delay_s``: a request is still running when its client leaves."""

    step_delay_s = 0.0

    def step(self):
        time.sleep(self.step_delay_s)
        return super().step()


def reference_ids(pair, ids: list[int], max_new: int) -> list[int]:
    return list(Engine(pair, make_policy("ar")).generate(ids, max_new).output_ids)


def test_ten_bad_requests_then_a_good_one(tiny_pair):
    engine = SlowBatchEngine(tiny_pair, make_policy("ar"))
    want = reference_ids(tiny_pair, tiny_pair.encode("good"), 5)
    bad = [
        ({"prompt": "hi", "temperature": 0.7}, 400, GREEDY_ONLY, "temperature"),
        ({"prompt": "hi", "n": 2}, 400, "n must be 1", "n"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist; this server serves 'tiny'", "model"),
        ({"prompt": "x" * 300}, 400, "the model's maximum is 256 positions", None),
        ('{"prompt": "hi", ', 400, "the body is not valid JSON", None),
        ({"max_tokens": 4}, 400, "prompt: Field required", "prompt"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens must be at least 1, got -3", "max_tokens"),
        ({"prompt": ""}, 400, EMPTY_PROMPT, "prompt"),
    ]
    with listening(engine) as (url, loop), httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        for body, status, message, param in bad:
            raw = {"content": body, "headers": {"Content-Type": "application/json"}}
            r = client.post("/v1/completions", **(raw if isinstance(body, str) else {"json": body}))
            error = r.json()["error"]
            assert r.status_code == status and message in error["message"] and error["param"] == param, r.text
            assert error["type"] == "invalid_request_error" and "\n" not in error["message"]

        # the tenth: a client that leaves mid-stream; its request is aborted, its rows freed
        engine.step_delay_s = 0.005
        with client.stream("POST", "/v1/completions", json={"prompt": "long", "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_until(lambda: loop.metrics.snapshot().requests_aborted == 1, "the abandoned stream is aborted")
        wait_until(lambda: loop.metrics.snapshot().stats.num_running == 0, "the engine is empty")
        stats = loop.metrics.snapshot().stats
        assert stats.num_waiting == 0 and stats.num_requests_finished == 0  # aborted, not run to its end
        engine.step_delay_s = 0.0

        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "good", "max_tokens": 5,
                                                  "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want


def test_outputs_are_exact_under_concurrency_through_the_openai_client(tiny_pair):
    """Requests sent at once, streamed and not, text and token-id prompts, completions and
    chat: every output's ids are the batch-1 greedy ones."""
    import openai
    texts = ["The cache keeps keys and", "def add(a, b):\n    return", "Once upon a time", "Once upon a time there"]
    max_new = [20, 13, 24, 8]
    prompts = [tiny_pair.encode(t) for t in texts]
    want = [reference_ids(tiny_pair, p, n) for p, n in zip(prompts, max_new)]
    chat_ids = tiny_pair.encode("user: hello\nassistant:")
    chat_want = reference_ids(tiny_pair, chat_ids, 12)
    engine = BatchEngine(tiny_pair, make_policy("joint-k4"),
                         batch=BatchConfig(max_num_seqs=4, max_num_batched_tokens=16))

    async def one(client, i: int) -> list[int]:
        prompt = texts[i] if i % 2 else prompts[i]  # text and token ids
        extra = {"extra_body": {"return_token_ids": True}}
        if i < 2:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_new[i], stream=True,
                                                     temperature=0, **extra)
            return [t async for chunk in stream for c in chunk.choices for t in c.model_extra["token_ids"]]
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_new[i], **extra)
        assert r.choices[0].text == tiny_pair.decode([t for t in want[i] if t != EOS_ID])
        return r.choices[0].model_extra["token_ids"]

    async def chat(client) -> str:
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=12)
        return r.choices[0].message.content

    async def drive(url: str):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=DEADLINE_S) as c:
            return await asyncio.wait_for(asyncio.gather(*[one(c, i) for i in range(4)], chat(c)), DEADLINE_S)

    with listening(engine) as (url, loop):
        *got, chat_text = asyncio.run(drive(url))
        models = httpx.get(f"{url}/v1/models").json()["data"]
        metrics = httpx.get(f"{url}/metrics").text
    assert got == want
    assert chat_text == tiny_pair.decode([t for t in chat_want if t != EOS_ID])
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 256
    assert metric(metrics, "rakv_time_to_first_token_seconds_count") == 5
    assert metric(metrics, "rakv_requests_finished_total") == 5 and metric(metrics, "rakv_spec_rounds_total") > 0


# -- the command line ---------------------------------------------------------------------
def test_defaults_serve_smollm2_on_localhost():
    args = parse_args([])
    assert (args.pair, args.host, args.port, args.api_key, args.policy) == ("smollm2", "127.0.0.1", 8000, None, "rakv")


def test_the_batching_options_reach_the_engine():
    from rakv.serve import build_engine
    engine = build_engine(parse_args(["--pair", "tiny", "--policy", "ar", "--max-num-seqs", "3",
                                      "--max-num-batched-tokens", "32", "--max-num-prefills", "2"]))
    assert (engine.batch.max_num_seqs, engine.batch.max_num_batched_tokens, engine.batch.max_num_prefills) == (3, 32, 2)
    assert parse_args([]).max_num_prefills == 1


def test_recalibrate_measures_the_pairs_timings_again(calibration_refreshes):
    from rakv.serve import build_engine
    for argv in (["--pair", "tiny"], ["--pair", "tiny", "--recalibrate"]):
        build_engine(parse_args(argv))
    assert calibration_refreshes == [False, True]


@pytest.mark.parametrize("argv, message", [
    (["--policy", "fastest"], "unknown policy 'fastest'"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    (["--max-num-prefills", "0"], "--max-num-prefills must be at least 1, got 0"),
    (["--memory-budget-mib", "-1"], "--memory-budget-mib must be positive"),
    (["--itl-target", "0"], "--itl-target must be positive, got 0"),
    (["--pair", "/nonexistent/model.gguf", "--policy", "ar", "--port", "0"],
     "GGUF file not found: /nonexistent/model.gguf"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and message in err and "Traceback" not in err


def test_a_port_in_use_is_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["--pair", "tiny", "--policy", "ar", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and len(err.strip().splitlines()) == 1


def test_python_m_rakv_serve_prints_its_url_serves_and_stops_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-m", "rakv.serve", "--pair", "tiny", "--policy", "ar", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(2 * DEADLINE_S)  # loading torch and the tiny pair on a busy machine
        line = lines[0].strip() if lines else proc.stderr.read() if proc.poll() is not None else "(no line)"
        assert line.startswith("serving tiny (weights fp32, policy ar) at http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[-1]
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=DEADLINE_S).json() == {"status": "ok"}
        r = httpx.post(f"{url}/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=DEADLINE_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted"
