"""A load generator for OpenAI-compatible servers (``rakv.serve``, llama.cpp's llama-server,
vLLM, ...), like ``vllm bench serve``: latency percentiles, throughput and goodput of
streamed greedy completions, several servers side by side.

    python -m bench.serve --server rakv=http://127.0.0.1:8000/v1 --request-rate 0.5,1,2
    python -m bench.serve --server rakv=http://127.0.0.1:8000/v1 --llama-server smollm2.gguf --concurrency 1,2,4,8
    python -m bench.serve --server rakv=http://127.0.0.1:8000/v1 --workload humaneval --num-prompts 20 \\
        --slo ttft=0.5,itl=0.1 --check --json serve.json --plot plots/

Every server gets the same prompts (a shipped workload or a JSONL file) at the same
seeded arrival times. Servers are driven one at a time, only through HTTP with the
official ``openai`` client: first each is asked for its model (``GET /v1/models``, the
first listed, unless ``--model``) and warmed up with ``--warmup`` untimed requests; then,
for each load point in turn, each server runs every prompt once. A load point is a
Poisson request rate (``inf``: all at once) or a fixed number of requests in flight.

Per request it measures TTFT, inter-token latencies, e2e and output tokens
(``bench.serve_stats`` defines each); per run the p50/p90/p99 of each, output tok/s,
requests/s and goodput under ``--slo``. ``--check`` then sends every prompt once more to
each server at concurrency 1 and counts the loaded runs' outputs that differ from it:
an exact server's greedy output does not depend on what else it is serving.

Output: one table row per server and load point on stdout; ``--json`` every run's summary
and per-request records (text, and token ids where the server streamed them); ``--plot``
p50 TTFT and ITL against output tok/s, one line per server. A server that does not
answer is a one-line error (status 2); a request that fails mid-run is counted as failed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, replace

from bench.serve_client import (RunResult, ServeError, Server, make_client, resolve_model, run_load,
                                warm_up)
from bench.serve_stats import RunSummary, Slo, count_differences, parse_slo, summarize
from bench.serve_workload import SHIPPED, Prompt, WorkloadFileError, load_prompts
from profiler.arrivals import arrivals_s, loads_type, seed_type
from rakv.cli import run_cli

LLAMA_NAME = "llama.cpp"


@dataclass(frozen=True)
class ServedRun:
    """One server at one load point: its summary and its requests' records."""

    summary: RunSummary
    records: tuple


@dataclass(frozen=True)
class BenchResult:
    """Every run in the order measured, the servers (with the models resolved), and each
    server's concurrency-1 records when ``--check`` ran them."""

    servers: tuple[Server, ...]
    runs: tuple[ServedRun, ...]
    references: dict


def load_points(args) -> tuple[str, tuple[float, ...]]:
    """``("rate", rates)`` or ``("concurrency", counts)`` from the arguments."""
    if args.concurrency is not None:
        return "concurrency", args.concurrency
    return "rate", args.request_rate


async def measure(specs: list[tuple[str, str]], prompts: tuple[Prompt, ...], args) -> BenchResult:
    """Resolve every server's model (all before any run, so a server that is down stops the
    bench at once), warm each up, then run each load point on each server in turn."""
    mode, loads = load_points(args)
    slo = args.slo
    clients = {name: make_client(url, args.api_key, args.timeout) for name, url in specs}
    try:
        servers = tuple([Server(name, url, await resolve_model(clients[name], name, url, args.model))
                         for name, url in specs])
        for server in servers:
            await warm_up(clients[server.name], server, prompts, args.warmup, args.timeout)
        runs = []
        for load in loads:
            arrivals = arrivals_s(len(prompts), load, args.seed) if mode == "rate" else None
            for server in servers:
                label = f"{server.name} c={load:g}" if mode == "concurrency" else f"{server.name} rate={load:g}"
                result: RunResult = await run_load(
                    clients[server.name], server.model, prompts, arrivals_s=arrivals,
                    concurrency=int(load) if mode == "concurrency" else None, timeout_s=args.timeout,
                    return_token_ids=args.return_token_ids, desc=label)
                summary = summarize(result.records, server.name, mode, load, slo, result.max_in_flight)
                warn_failures(f"{server.name} {summary.load_label}", result.records)
                runs.append(ServedRun(summary, result.records))
        references = {}
        if args.check:
            for server in servers:
                reference = await run_load(clients[server.name], server.model, prompts, concurrency=1,
                                           timeout_s=args.timeout, return_token_ids=args.return_token_ids,
                                           desc=f"{server.name} check (c=1)")
                warn_failures(f"{server.name} check (c=1)", reference.records)
                references[server.name] = reference.records
            runs = [replace(run, summary=replace(run.summary, check=count_differences(
                        run.records, references[run.summary.server]))) for run in runs]
        return BenchResult(servers, tuple(runs), references)
    finally:
        for client in clients.values():
            await client.close()


def warn_failures(label: str, records) -> None:
    """One line on stderr for a run with failed requests: how many, and the commonest reason."""
    errors = [r.error for r in records if not r.ok]
    if errors:
        reason, count = Counter(errors).most_common(1)[0]
        print(f"warning: {label}: {len(errors)} of {len(records)} requests failed ({count}: {reason})",
              file=sys.stderr)


def server_spec(text: str) -> tuple[str, str]:
    """argparse's type for ``--server NAME=URL``."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://HOST:PORT/v1, got {text!r}")
    return name, url.rstrip("/")


def _slo_type(text: str) -> Slo:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    servers = p.add_argument_group("servers")
    servers.add_argument("--server", type=server_spec, action="append", default=[], metavar="NAME=URL",
                         help="a server to measure, by its name in the table and its OpenAI base URL "
                              "(e.g. rakv=http://127.0.0.1:8000/v1); repeat for several, measured side by side")
    servers.add_argument("--model", help="the model name sent with every request (default: the first model each "
                                         "server lists at GET /v1/models)")
    servers.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         help="the bearer token sent to every server (default: $OPENAI_API_KEY, else EMPTY)")
    servers.add_argument("--llama-server", metavar="GGUF",
                         help=f"also start llama.cpp's llama-server on GGUF (127.0.0.1, a free port, one thread, "
                              f"continuous batching) as the server {LLAMA_NAME!r}, stopped at the end; built by "
                              f"python -m bench.llamacpp --build-server")
    servers.add_argument("--slots", type=_positive_int, default=8,
                         help="llama-server's parallel sequences (-np; default: 8)")
    servers.add_argument("--llama-slot-ctx", type=_positive_int, default=2048,
                         help="context tokens per llama-server slot; its -c is SLOTS times this (default: 2048)")
    servers.add_argument("--llama-start-timeout", type=_positive_float, default=300.0,
                         help="seconds to wait for llama-server's /health to answer 200 (default: 300)")
    work = p.add_argument_group("prompts")
    work.add_argument("--workload", default="general",
                      help=f"a shipped workload ({', '.join(SHIPPED)}) or a .jsonl file of "
                           f'{{"prompt": TEXT, "max_tokens": N}} lines (default: general)')
    work.add_argument("--num-prompts", type=_positive_int,
                      help="the first N prompts (default: the workload's own size; general has 25)")
    work.add_argument("--max-tokens", type=_positive_int, default=64,
                      help="max_tokens of each request, unless its JSONL line says (default: 64)")
    work.add_argument("--seed", type=seed_type, default=0,
                      help="the seed of the arrival times and of a sampled workload's choice (default: 0)")
    load = p.add_argument_group("load (one of)").add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=loads_type("--request-rate", False), default=(math.inf,),
                      metavar="R[,R...]", help="Poisson arrivals at R requests/s (inf: all at once); a list runs "
                                               "each rate in turn (default: inf)")
    load.add_argument("--concurrency", type=loads_type("--concurrency", True), metavar="C[,C...]",
                      help="keep C requests in flight (the next sent when one finishes); a list runs each in turn")
    run = p.add_argument_group("measurement")
    run.add_argument("--warmup", type=int, default=2,
                     help="untimed requests to each server, one at a time, before any run (default: 2)")
    run.add_argument("--slo", type=_slo_type, default=Slo(), metavar="ttft=S,itl=S,e2e=S",
                     help="bounds in seconds for goodput: requests/s that completed within every bound stated "
                          "(itl: the request's mean inter-token latency); default: none (goodput = requests/s)")
    run.add_argument("--check", action="store_true",
                     help="afterwards, send every prompt to each server once more at concurrency 1 and report "
                          "how many of each run's outputs differ from it (token ids where streamed, else text)")
    run.add_argument("--return-token-ids", action="store_true",
                     help="ask for each chunk's token ids (vLLM's return_token_ids); a server that streams "
                          "'token_ids' anyway has them read without it")
    run.add_argument("--timeout", type=_positive_float, default=600.0,
                     help="seconds a request may take before it counts as failed (default: 600)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write every run's summary and per-request records to FILE")
    out.add_argument("--plot", metavar="DIR", help="write DIR/latency_throughput.png: p50 TTFT and ITL against "
                                                   "output tok/s, one line per server")
    return p


def bench(args) -> int:
    from bench.serve_report import print_table, write_json, write_plot
    prompts = load_prompts(args.workload, args.num_prompts, args.seed, args.max_tokens)
    specs = list(args.server)
    with contextlib.ExitStack() as stack:
        if args.llama_server:
            from bench.llama_server import LlamaServer
            llama = stack.enter_context(LlamaServer(args.llama_server, args.slots, args.llama_slot_ctx,
                                                    args.llama_start_timeout))
            specs.append((LLAMA_NAME, llama.base_url))
        result = asyncio.run(measure(specs, prompts, args))
    mode, loads = load_points(args)
    print(f"{args.workload}: {len(prompts)} prompts, max_tokens {args.max_tokens}, seed {args.seed}; "
          f"{mode} {','.join(f'{v:g}' for v in loads)}; SLO {args.slo.describe()}; "
          + "; ".join(f"{s.name}: {s.model} at {s.base_url}" for s in result.servers))
    print_table([run.summary for run in result.runs])
    if args.json:
        unused = {"api_key", "request_rate", "concurrency"}  # a secret, and the load options: as mode and loads
        config = {k: v for k, v in vars(args).items() if k not in unused}
        write_json(args.json, result, config | {"num_prompts": len(prompts), "mode": mode, "loads": loads})
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        path = write_plot(args.plot, [run.summary for run in result.runs])
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.server and not args.llama_server:
        p.error("give at least one --server NAME=URL or --llama-server GGUF")
    names = [name for name, _ in args.server] + ([LLAMA_NAME] if args.llama_server else [])
    if len(set(names)) != len(names):
        p.error(f"server names must differ; got {', '.join(names)}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return run_cli(bench, args, (ServeError, WorkloadFileError, OSError))


if __name__ == "__main__":
    sys.exit(main())
