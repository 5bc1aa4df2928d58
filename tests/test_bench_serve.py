"""bench.serve, the load generator: its statistics on known numbers, its seeded arrivals,
and end to end against a fake OpenAI-compatible streaming server (FastAPI + uvicorn on
127.0.0.1 in a thread) that counts the requests it has in flight. No llama.cpp is run:
its start, readiness polling and shutdown are checked on a stand-in process."""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handlers' string annotations here
from fastapi.responses import StreamingResponse

from bench import serve
from bench.llama_server import LlamaServer, server_command, stop, wait_ready
from bench.serve_client import ServeError, make_client, run_load
from bench.serve_stats import (RequestRecord, Slo, count_differences, inter_token_latencies, meets_slo, parse_slo,
                               percentiles, split_tokens, summarize)
from bench.serve_workload import Prompt, load_prompts, read_jsonl
from profiler.arrivals import arrivals_s

MODEL = "fake-model"


# ---------------------------------------------------------------------------------------
# A fake OpenAI-compatible server


@dataclass
class FakeServer:
    """Streams ``fake_tokens(prompt)`` one token a chunk (``per_chunk`` a chunk, with each
    chunk's ``token_ids`` when ``token_ids``), ``delay_s`` before each chunk. ``differ`` is a
    prompt whose last token changes when another request is in flight as it arrives (a
    server whose output depends on its batch); ``fail`` a prompt whose stream breaks after
    its first chunk."""

    delay_s: float = 0.004
    per_chunk: int = 1
    token_ids: bool = False
    differ: str | None = None
    fail: str | None = None
    in_flight: int = 0
    max_in_flight: int = 0
    prompts: list = field(default_factory=list)
    url: str = ""


def fake_tokens(prompt: str, max_tokens: int) -> list[tuple[int, str]]:
    seed = int(hashlib.sha256(prompt.encode()).hexdigest(), 16)
    return [((seed >> (8 * i)) % 1000, f" w{(seed >> (8 * i)) % 1000}") for i in range(min(max_tokens, 6))]


def make_app(state: FakeServer):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, max_tokens = body["prompt"], body.get("max_tokens", 16)
        state.prompts.append(prompt)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        tokens = fake_tokens(prompt, max_tokens)
        if prompt == state.differ and state.in_flight > 1:
            tokens[-1] = (999, " crowded")
        usage = (body.get("stream_options") or {}).get("include_usage")

        def event(choices, **more) -> str:
            return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                                          "choices": choices, **more}) + "\n\n"

        async def events():
            counted = True
            try:
                for start in range(0, len(tokens), state.per_chunk):
                    await asyncio.sleep(state.delay_s)
                    if prompt == state.fail and start > 0:
                        raise RuntimeError("the fake server broke mid-stream")
                    part = tokens[start:start + state.per_chunk]
                    choice = {"index": 0, "text": "".join(t for _, t in part), "logprobs": None, "finish_reason": None}
                    if state.token_ids:
                        choice["token_ids"] = [i for i, _ in part]
                    yield event([choice])
                if usage:
                    yield event([], usage={"prompt_tokens": 1, "completion_tokens": len(tokens),
                                           "total_tokens": len(tokens) + 1})
                # out of flight before [DONE]: the client cannot start its next request earlier
                state.in_flight -= 1
                counted = False
                yield "data: [DONE]\n\n"
            finally:
                if counted:
                    state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server():
    """A factory of fake servers on 127.0.0.1, each stopped at the test's end."""
    import uvicorn
    running = []

    def start(**options) -> FakeServer:
        state = FakeServer(**options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="critical", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        state.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        running.append((server, thread, sock))
        return state

    yield start
    for server, thread, sock in running:
        server.should_exit = True
        thread.join(5)
        sock.close()


def prompts_of(*texts: str, max_tokens: int = 6) -> tuple[Prompt, ...]:
    return tuple(Prompt(i, text, max_tokens) for i, text in enumerate(texts))


async def _run(url: str, prompts, **options):
    client = make_client(url, "EMPTY", 30.0)
    try:
        return await run_load(client, MODEL, prompts, **options)
    finally:
        await client.close()


# ---------------------------------------------------------------------------------------
# Pure statistics


def test_percentiles_on_known_numbers():
    p = percentiles(range(1, 101))
    assert (p.p50_s, p.p90_s, p.p99_s, p.mean_s) == pytest.approx((50.5, 90.1, 99.01, 50.5))
    assert all(math.isnan(v) for v in (percentiles([]).p50_s, percentiles([]).mean_s))


def record(index, sent_s, ttft_s, itl_s, e2e_s, tokens, error=None):
    return RequestRecord(index, sent_s, ttft_s, e2e_s, tuple(itl_s), tokens, "usage", "x", None, error)


def test_goodput_and_throughput_arithmetic():
    records = (record(0, 0.0, 0.2, [0.05, 0.05], 0.3, 3),  # meets ttft<=0.5, itl<=0.1
               record(1, 1.0, 0.8, [0.05], 0.9, 2),  # TTFT too slow
               record(2, 2.0, 0.1, [0.05, 0.25], 0.4, 3),  # mean ITL 0.15: too slow
               record(3, 3.0, 0.3, [], 1.0, 1),  # one token, no ITL: meets
               record(4, 3.5, None, [], None, 0, error="boom"))  # failed: never meets
    slo = parse_slo("ttft=0.5,itl=0.1")
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, "fake", "rate", 2.0, slo, max_in_flight=2)
    assert s.wall_s == pytest.approx(4.0)  # first send 0, last finish 3 + 1
    assert (s.completed, s.failed, s.output_tokens) == (4, 1, 9)
    assert s.output_tok_per_s == pytest.approx(9 / 4) and s.requests_per_s == pytest.approx(1.0)
    assert s.goodput_per_s == pytest.approx(2 / 4) and s.goodput_share == pytest.approx(2 / 5)
    assert s.ttft.p50_s == pytest.approx(0.25)  # of 0.2, 0.8, 0.1, 0.3
    assert s.itl.mean_s == pytest.approx(0.45 / 5)
    assert summarize(records, "fake", "rate", 2.0, Slo(), 2).goodput_per_s == pytest.approx(1.0)  # no SLO: req/s


def test_tokens_per_chunk_and_inter_token_latencies():
    assert split_tokens([4, 8, 4], 3) == [1, 1, 1]
    assert split_tokens([4, 8, 4], 7) == [2, 3, 2]  # one each, then 4 more by characters
    assert sum(split_tokens([1, 5, 9, 2], 23)) == 23
    # a chunk of 3 tokens 30 ms after the previous is three 10 ms latencies
    assert inter_token_latencies([0.0, 0.03, 0.05], [2, 3, 1]) == pytest.approx((0.01, 0.01, 0.01, 0.02))


def test_slo_parsing():
    assert parse_slo("ttft=0.5, e2e=4") == Slo(ttft_s=0.5, e2e_s=4.0)
    for bad in ("tpot=1", "ttft", "ttft=x", "itl=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    a = arrivals_s(20_000, 4.0, seed=0)
    assert a == arrivals_s(20_000, 4.0, seed=0) and a != arrivals_s(20_000, 4.0, seed=1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.03)
    assert arrivals_s(50, 2.0, 0) == pytest.approx(tuple(t / 2 for t in arrivals_s(50, 1.0, 0)))
    assert arrivals_s(3, math.inf, 0) == (0.0, 0.0, 0.0)


def test_check_counts_by_token_ids_where_both_have_them():
    ref = (RequestRecord(0, 0, 0.1, 0.2, (), 2, "token_ids", "ab", (1, 2)),
           RequestRecord(1, 0, 0.1, 0.2, (), 1, "chunks", "c"))
    run = (RequestRecord(0, 0, 0.1, 0.2, (), 2, "token_ids", "ab", (1, 3)),
           RequestRecord(1, 0, 0.1, 0.2, (), 1, "chunks", "c"))
    check = count_differences(run, ref)
    assert (check.differ, check.compared, check.by_token_ids) == (1, 2, 1) and check.describe() == "1 of 2 differ"


# ---------------------------------------------------------------------------------------
# Prompts


def test_jsonl_prompts_and_their_errors(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b", "id": 7}\n')
    assert [(p.text, p.max_tokens) for p in read_jsonl(good, None, 9)] == [("a", 3), ("b", 9)]
    for line, message in (('{"prompt": "a"', "not valid JSON"), ('["a"]', "expected a JSON object"),
                          ('{"text": "a"}', "'prompt' must be non-empty text"),
                          ('{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be an integer >= 1")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "ok"}\n\n' + line + "\n")
        code = serve.main(["--server", "x=http://127.0.0.1:9/v1", "--workload", str(bad)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"{bad}:3: {message}" in err
    assert len(load_prompts("general", 3, 0, 8)) == 3


# ---------------------------------------------------------------------------------------
# Against the fake server


def test_fixed_concurrency_never_exceeds_c(fake_server):
    state = fake_server()
    result = asyncio.run(_run(state.url, prompts_of(*(f"prompt {i}" for i in range(10))), concurrency=3))
    assert state.max_in_flight == 3 and result.max_in_flight == 3
    assert all(r.ok and r.output_tokens == 6 and r.tokens_from == "usage" for r in result.records)
    assert all(len(r.itl_s) == 5 and r.ttft_s > 0 for r in result.records)


def test_streamed_token_ids_failures_and_continued_turns(fake_server):
    state = fake_server(per_chunk=2, token_ids=True, fail="broken")
    prompts = (Prompt(0, "first", 6), Prompt(1, "broken", 6), Prompt(2, " then", 6, continues=0),
               Prompt(3, " after", 6, continues=1))
    result = asyncio.run(_run(state.url, prompts, arrivals_s=(0.0, 0.0, 0.0, 0.0)))
    first, broken, then, after = result.records
    assert first.ok and first.token_ids == tuple(i for i, _ in fake_tokens("first", 6))
    assert first.tokens_from == "token_ids" and len(first.itl_s) == 4  # chunks of 2: the first's 2 add none
    assert not broken.ok and after.error == "its earlier turn (prompt 1) failed"
    assert then.ok and ("first" + first.text + " then") in state.prompts


def test_server_down_is_one_line_and_status_2(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        code = serve.main(["--server", f"down=http://127.0.0.1:{port}/v1", "--num-prompts", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: server down at") and "Traceback" not in err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    async def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(serve, "measure", interrupted)
    assert serve.main(["--server", "x=http://127.0.0.1:9/v1", "--num-prompts", "2"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_full_run_side_by_side_with_check_json_and_plot(fake_server, tmp_path, capsys):
    texts = [p.text for p in load_prompts("general", 5, 0, 6)]
    exact = fake_server(token_ids=True)
    # streams long enough (6 chunks of 50 ms) that the five sent at once overlap even on a
    # busy machine: at 4 ms a chunk, CI once saw the third arrive after the others had ended
    batch_dependent = fake_server(differ=texts[2], delay_s=0.05)
    out = tmp_path / "out" / "serve.json"
    code = serve.main(["--server", f"exact={exact.url}", "--server", f"batchy={batch_dependent.url}",
                       "--num-prompts", "5", "--max-tokens", "6", "--request-rate", "inf,50", "--warmup", "1",
                       "--slo", "ttft=5,itl=1", "--check", "--json", str(out), "--plot", str(tmp_path / "plots")])
    stdout = capsys.readouterr().out
    assert code == 0
    rows = [line for line in stdout.splitlines() if line.startswith("| exact") or line.startswith("| batchy")]
    assert len(rows) == 4  # 2 servers x 2 load points
    assert all("0 of 5 differ" in row for row in rows if row.startswith("| exact"))
    assert "1 of 5 differ" in next(row for row in rows if row.startswith("| batchy") and "rate=inf" in row)
    document = json.loads(out.read_text())
    assert [run["summary"]["server"] for run in document["runs"]] == ["exact", "batchy", "exact", "batchy"]
    assert document["runs"][0]["summary"]["load"] == "inf" and document["runs"][0]["summary"]["check"]["differ"] == 0
    first = document["runs"][0]["requests"][0]
    assert first["token_ids"] == [i for i, _ in fake_tokens(texts[0], 6)] and first["text"]
    assert document["runs"][1]["requests"][0]["token_ids"] is None  # batchy streams no ids
    assert all(run["summary"]["goodput_share"] == 1.0 for run in document["runs"])
    assert set(document["check_reference"]) == {"exact", "batchy"}
    assert (tmp_path / "plots" / "latency_throughput.png").stat().st_size > 1000
    # warm-up (1) + 2 runs + the check (1) of 5 prompts each
    assert len(exact.prompts) == 1 + 3 * 5


# ---------------------------------------------------------------------------------------
# llama-server's code path, on a stand-in process (llama.cpp is never run in tests)


def test_llama_server_command_line(tmp_path):
    command = server_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8123, slots=4, slot_ctx=1024)
    assert command[command.index("-np") + 1] == "4" and command[command.index("-c") + 1] == "4096"
    assert command[command.index("-t") + 1] == "1" and "--cont-batching" in command
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "8123"


STAND_IN = '''
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
polls = [0]
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        polls[0] += 1
        self.send_response(200 if polls[0] > 2 else 503)  # llama-server answers 503 while loading
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def test_llama_server_start_readiness_and_stop(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{STAND_IN}")
    binary.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with LlamaServer(gguf, slots=2, start_timeout_s=20, binary=binary) as server:
        process = server.process
        assert server.base_url.startswith("http://127.0.0.1:") and process.poll() is None
    assert process.poll() is not None  # stopped on exit
    with pytest.raises(ServeError, match="python -m bench.llamacpp --build-server"):
        LlamaServer(gguf, binary=tmp_path / "missing").__enter__()


def test_wait_ready_gives_up_on_a_dead_process_and_stop_ends_a_live_one():
    import subprocess
    with pytest.raises(ServeError, match="exited before it was ready"):
        wait_ready("http://127.0.0.1:9/health", lambda: False, timeout_s=5)
    with pytest.raises(ServeError, match="not ready after"):
        wait_ready("http://127.0.0.1:9/health", lambda: True, timeout_s=0.3, poll_s=0.1)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop(process, grace_s=5) is not None and process.poll() is not None


def test_llama_build_configures_makefiles_only_for_a_new_build_directory(tmp_path):
    from bench.llamacpp import configure_command
    fresh = configure_command(tmp_path / "src", tmp_path / "build")
    assert fresh[fresh.index("-G") + 1] == "Unix Makefiles" and "-DLLAMA_BUILD_SERVER=ON" in fresh
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "CMakeCache.txt").write_text("")
    assert "-G" not in configure_command(tmp_path / "src", tmp_path / "build")  # CMake keeps its generator
