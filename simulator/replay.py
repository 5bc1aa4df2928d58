"""``python -m simulator.replay``: what would each policy cost on a recorded workload?

Discrete-event replay at batch 1 with an FCFS queue: requests arrive (``simulator.schedule``),
wait while the engine serves earlier ones, and are served by the engine's own store
model, policy and round planner (``simulator.session``: decisions and acceptance are
exact), at the cost the per-op model gives the engine's work (``simulator.costs``). Two
oracles bound the policies, and each policy's regret is its total service time over
theirs, minus one: the oracle (``simulator.oracle``) prices every request-level choice of
every request and takes the cheapest; the round oracle (``simulator.round_oracle``) takes
each request's best schedule of rounds, knowing the run lengths.

    python -m simulator.replay                                   # a shipped trace, every policy
    python -m simulator.replay --trace traces/smollm2-sharegpt --policy rakv --requests 10000 --json
    python -m simulator.replay --trace traces/qwen-coder-humaneval --set planner.min_gain=0.2
    python -m simulator.replay --trace traces/smollm2-chat --as-recorded
    python -m simulator.replay --trace traces/qwen-coder-chat-serve --policy ar,rakv --concurrency 1,2,4,8

On a serving trace (batched forwards in its ops, or recorded steps) the replay serves loads
through the batching engine's replay instead (``simulator.load_replay``): ``--concurrency``
closed loops and ``--arrival-rate`` open loops (comma lists: a sweep; default: the loads the
trace recorded), one row per load and policy; the oracles are batch-1 only, and under load
``simulator.foresight`` stands beside the policies as a reference (in ``all``), and so may
``simulator.causal_bound`` (named: it replays ``rakv`` under each of its settings first).

A replay decides with today's engine settings over the trace's facts (tokens, run
lengths, probabilities, op timings, calibration, model sizes), unless ``--as-recorded``;
``--set`` and ``--settings`` change any setting; the output names the settings it ran.
Imports no torch.
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from profiler.arrivals import parse_seeds
from profiler.schema import TraceError
from rakv.cli import run_cli
from rakv.choices import ADAPTIVE_NAME, FIXED_POLICY_HELP, fixed_policy_names
from rakv.policies import LEARNED, check_policy, shipped_policy
from rakv.scheduler import ITL_TARGET_HELP, MAX_NUM_PREFILLS_HELP, TTFT_TARGET_HELP
from rakv.settings import SECTIONS, DecisionInputs, Settings, differences, override, overrides_from_json
from simulator.causal_bound import LOAD_GRID, MEANING as CAUSAL_MEANING, NAME as CAUSAL, num_settings
from simulator.costs import CostModelError, request_cost
from simulator.foresight import MEANING as FORESIGHT_MEANING, NAME as FORESIGHT
from simulator.load_replay import has_serving_grid, progress_bar, serve_loads
from simulator.oracle import Oracle
from simulator.round_oracle import NAME as ROUND_ORACLE, RoundOracle
from simulator.schedule import Arrival, ScheduleError, schedule
from simulator.serve_validate import check_targets
from simulator.session import Session, SessionError, trace_policy
from simulator.sweep_summary import REFERENCES
from simulator.timing import Timing, load_timing
from simulator.trace import Trace, load_trace, under_ngram

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "smollm2-chat"
ORACLES = {ROUND_ORACLE: RoundOracle, "oracle": Oracle}  # replayed first: every policy's regret is against them


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class Served:
    """One request as a policy served it; times from its arrival."""

    request_id: int
    arrival_s: float
    ttft_s: float  # queueing included
    e2e_s: float  # queueing included
    service_s: float
    num_prompt_tokens: int
    hit_tokens: int
    reused_tokens: int
    num_output_tokens: int
    num_rounds: int
    num_accepted: int
    action: str  # what ran (rakv.choices.Choice)


@dataclass(frozen=True)
class PolicySummary:
    policy: str
    num_requests: int
    mean_e2e_s: float
    p50_e2e_s: float
    p99_e2e_s: float
    mean_ttft_s: float
    tokens_per_s: float  # output tokens over the time from the first arrival to the last finish
    hit_rate: float  # fraction of requests that reused stored KV
    mean_accepted_per_round: float
    total_service_s: float
    regret_vs_oracle: float | None  # total service time over the oracle's, minus one
    regret_vs_round_oracle: float | None  # total service time over the round oracle's, minus one
    action_histogram: dict[str, int]
    settings: Settings  # what the policy decided with: the replay's, or a learned policy's own controller


def serve(session: Session, arrival: Arrival, start_s: float, timing: Timing) -> Served:
    request = arrival.request
    replayed = session.run(request, request.max_new_tokens)
    cost = request_cost(replayed, len(request.prompt_ids), timing.costs, session.inputs, timing.overhead)
    wait_s = start_s - arrival.arrival_s
    return Served(request.request_id, arrival.arrival_s, wait_s + cost.ttft_s, wait_s + cost.e2e_s, cost.e2e_s,
                  len(request.prompt_ids), replayed.hit_tokens, replayed.store.reuse.reused_tokens,
                  replayed.num_output_tokens, len(replayed.rounds), sum(r.accepted for r in replayed.rounds),
                  replayed.label)


def simulate(arrivals: list[Arrival], session: Session, timing: Timing, progress=None) -> list[Served]:
    """Batch 1, FCFS: pop an event, handle it, start the next request when the engine is free."""
    events = [(a.arrival_s, i, a) for i, a in enumerate(arrivals)]  # (time, tie-break, arrival or Served)
    heapq.heapify(events)
    queue: deque[Arrival] = deque()
    served: list[Served] = []
    busy, counter = False, len(events)
    while events:
        now, _, event = heapq.heappop(events)
        if isinstance(event, Arrival):
            queue.append(event)
        else:
            served.append(event)
            busy = False
            if progress is not None:
                progress.update(1)
        if not busy and queue:
            done = serve(session, queue.popleft(), now, timing)
            heapq.heappush(events, (now + done.service_s, counter, done))
            busy, counter = True, counter + 1
    return served


def summarize(policy: str, served: list[Served], settings: Settings, oracle_service_s: float | None = None,
              round_oracle_service_s: float | None = None) -> PolicySummary:
    e2e = np.array([s.e2e_s for s in served])
    span_s = max(s.arrival_s + s.e2e_s for s in served) - min(s.arrival_s for s in served)
    rounds = sum(s.num_rounds for s in served)
    total_s = float(sum(s.service_s for s in served))
    return PolicySummary(
        policy=policy, num_requests=len(served), mean_e2e_s=float(e2e.mean()),
        p50_e2e_s=float(np.percentile(e2e, 50)), p99_e2e_s=float(np.percentile(e2e, 99)),
        mean_ttft_s=float(np.mean([s.ttft_s for s in served])),
        tokens_per_s=sum(s.num_output_tokens for s in served) / span_s,
        hit_rate=sum(s.reused_tokens > 0 for s in served) / len(served),
        mean_accepted_per_round=sum(s.num_accepted for s in served) / rounds if rounds else 0.0,
        total_service_s=total_s,
        regret_vs_oracle=None if oracle_service_s is None else total_s / oracle_service_s - 1.0,
        regret_vs_round_oracle=None if round_oracle_service_s is None else total_s / round_oracle_service_s - 1.0,
        action_histogram=dict(Counter(s.action for s in served).most_common()), settings=settings)


def policy_names(spec: str, trace: Trace, inputs: DecisionInputs) -> list[str]:
    """``all`` (with ``learned`` when the trace's pair has a shipped policy), or a
    comma-separated list; unknown names fail before any replay."""
    pair = trace.meta.models.get("pair")
    if spec == "all":
        shipped = [LEARNED] if shipped_policy(pair) is not None else []
        return list(fixed_policy_names(inputs.draft_sizes is not None)) + [ADAPTIVE_NAME] + shipped + list(ORACLES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in ORACLES and name not in REFERENCES:
            check_policy(name, pair, inputs.draft_sizes is not None)  # the one-line error naming the choices
    return names


def make_session(name: str, trace: Trace, inputs: DecisionInputs, timing: Timing, strict: bool = False) -> Session:
    """A session of the named policy, resolved as ``rakv.generate`` resolves it
    (``rakv.policies``); a learned policy decides with its own controller settings."""
    if name in ORACLES:
        return ORACLES[name](inputs, timing.costs, timing.overhead, trace.target_namespace, trace.draft_namespace)
    return Session(trace_policy(name, trace, inputs, strict), inputs, trace.target_namespace, trace.draft_namespace)


def replay(trace: Trace, timing: Timing, names: list[str], arrivals: list[Arrival],
           settings: Settings | None = Settings(),
           strict: bool = False) -> dict[str, tuple[PolicySummary, list[Served]]]:
    """Every named policy over the same arrivals (the oracles, the regrets' baselines,
    included), deciding with ``settings`` (default: today's; None: the trace's recorded ones)."""
    inputs = timing.decision_inputs(trace, settings)
    trace = under_ngram(trace, inputs.engine.ngram)
    order = list(ORACLES) + [n for n in names if n not in ORACLES]
    progress = progress_bar(len(order) * len(arrivals), "replay")
    ran = {}
    for name in order:
        session = make_session(name, trace, inputs, timing, strict)
        settings_ran = replace(inputs.settings, controller=getattr(session.policy, "controller", inputs.controller))
        ran[name] = (simulate(arrivals, session, timing, progress), settings_ran)
    baselines = [sum(s.service_s for s in ran[oracle][0]) for oracle in ("oracle", ROUND_ORACLE)]
    results = {name: (summarize(name, served, settings_ran, *baselines), served)
               for name, (served, settings_ran) in ran.items()}
    if progress is not None:
        progress.close()
    return {name: results[name] for name in names}


def markdown(summaries: list[PolicySummary], title: str) -> str:
    lines = [f"{title}", "",
             "| policy | mean e2e (s) | p50 (s) | p99 (s) | mean TTFT (s) | tok/s | hit rate | accepted/round "
             "| regret vs oracle | vs round oracle | most frequent action |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        action, count = next(iter(s.action_histogram.items()))
        lines.append(f"| {s.policy} | {s.mean_e2e_s:.3f} | {s.p50_e2e_s:.3f} | {s.p99_e2e_s:.3f} | {s.mean_ttft_s:.3f} "
                     f"| {s.tokens_per_s:.2f} | {s.hit_rate:.2f} | {s.mean_accepted_per_round:.2f} "
                     f"| {100 * s.regret_vs_oracle:+.1f}% | {100 * s.regret_vs_round_oracle:+.1f}% "
                     f"| {action} x{count} |")
    return "\n".join(lines)


def gap_line(summaries: list[PolicySummary]) -> str | None:
    """One line on what separates ``rakv`` from the round oracle, and how much of it the
    learned policy takes; None unless both are in the replay."""
    by_name = {s.policy: s for s in summaries}
    if ADAPTIVE_NAME not in by_name or ROUND_ORACLE not in by_name:
        return None
    rakv, best = by_name[ADAPTIVE_NAME].tokens_per_s, by_name[ROUND_ORACLE].tokens_per_s
    line = (f"The round oracle ({best:.2f} tok/s) knows each round's run length before drafting, so it never drafts "
            f"a token the target rejects; rakv ({rakv:.2f}) is {best / rakv - 1:.0%} behind it")
    learned = next((s for s in summaries if s.policy.startswith(LEARNED)), None)
    if learned is not None and best > rakv:
        line += (f", and the learned round planner ({learned.tokens_per_s:.2f}) takes "
                 f"{(learned.tokens_per_s - rakv) / (best - rakv):.0%} of that gap")
    return line + "."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m simulator.replay",
        description="Replay a recorded workload under any policy: exact decisions and acceptance, "
                    "costs from the trace's per-op timings. Prints one row per policy; on a serving trace, one "
                    "row per load and policy, served by the batching engine's replay.")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help=f"acceptance trace directory (default: {DEFAULT_TRACE.relative_to(DEFAULT_TRACE.parents[1])})")
    p.add_argument("--timing", type=Path, default=None,
                   help="timing trace of the same model shapes, perhaps another machine's (default: the trace's "
                        "own ops, else the timing trace its metadata names)")
    p.add_argument("--policy", default="all",
                   help=f"all (default; under load, without the oracles and with foresight), or comma-separated: "
                        f"{FIXED_POLICY_HELP}, oracle, round-oracle (batch 1 only), {FORESIGHT} (under load only: "
                        f"{FORESIGHT_MEANING}, a reference), {CAUSAL} (under load only: {CAUSAL_MEANING}: "
                        f"rakv replayed under {num_settings(LOAD_GRID)} settings first, a reference), learned[=PATH] "
                        "(a policy.train directory; learned alone: the shipped one of the trace's pair)")
    p.add_argument("--strict", action="store_true",
                   help="a learned policy trained for other models is an error, not a fallback to rakv")
    p.add_argument("--as-recorded", action="store_true",
                   help="decide with the settings the trace was recorded with, and under load with the learned "
                        "policy files it served (default: today's engine defaults and shipped policies)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change one setting, e.g. planner.min_gain=0.2 or store.mode=prompt (sections: "
                        f"{', '.join(SECTIONS)}); repeatable, applied after --settings")
    p.add_argument("--settings", type=Path, default=None, metavar="FILE",
                   help='a JSON file of settings by section, e.g. {"planner": {"min_gain": 0.2}}')
    p.add_argument("--budget-mib", type=float, default=None,
                   help="prefix store budget (short for --set store.budget_bytes=...; default: the settings')")
    p.add_argument("--arrival-rate", default=None, metavar="R[,R...]",
                   help="Poisson arrivals per second (default: the recorded arrival times); on a serving trace "
                        "a comma list of open-loop loads (inf: all at once; with neither this nor --concurrency, "
                        "the loads the trace recorded)")
    p.add_argument("--requests", type=int, default=None,
                   help="resample the trace's requests, with their prefix families, to this many (default: as recorded)")
    p.add_argument("--seed", default=None, metavar="S[,S...]",
                   help="seed of the resampling and the arrivals (default: 0; a serving trace's: its recording's); "
                        "under load a comma list replays each load under each seed and pools their requests "
                        "(percentiles over all; goodput and tok/s over their spans summed)")
    load = p.add_argument_group("under load (a serving trace: profiler.record --grid serving --serve-concurrency)")
    load.add_argument("--concurrency", default=None, metavar="C[,C...]",
                      help="closed loops: keep C requests in flight, the next submitted when one finishes")
    load.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                      help="running requests at most (default: the recording's)")
    load.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                      help="rows of one step at most (default: the recording's)")
    load.add_argument("--max-num-prefills", type=int, default=None, metavar="N",
                      help=f"{MAX_NUM_PREFILLS_HELP} (default: the recording's; a recording made before the option "
                           f"existed: max_num_seqs, as its engine prefilled)")
    load.add_argument("--itl-target", type=float, default=None, metavar="S",
                      help=f"{ITL_TARGET_HELP}; 0: none (default: the recording's)")
    load.add_argument("--ttft-target", type=float, default=None, metavar="S",
                      help=f"{TTFT_TARGET_HELP}; 0: none (default: the recording's)")
    load.add_argument("--slo", default=None, metavar="ttft=S,itl=S,e2e=S",
                      help="bounds in seconds, any subset, for goodput: the requests meeting every bound per second "
                           "(itl: a request's mean inter-token latency); default: no goodput")
    load.add_argument("--attainment", default=None, metavar="GOAL[,GOAL...]",
                      help="with --slo and a sweep of --arrival-rate values: each policy's capacity, the highest "
                           "Poisson rate at which it keeps at least GOAL (a share, e.g. 0.9: DistServe's goodput) of "
                           "its requests within the SLO, bisected between the sweep's rates to 1 %%; a comma list "
                           "(0.9,0.95) gives each goal's from the one sweep")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per policy (under load: per load and policy, then per policy its "
                        "capacity with --attainment) instead of a table")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="also write PNG figures into DIR (under load: latency_vs_load, speculation_vs_batch, and with "
                        "--attainment attainment_vs_rate)")
    return p.parse_args(argv)


def replay_settings(args: argparse.Namespace, trace: Trace) -> Settings | None:
    """Today's defaults, or with ``--as-recorded`` the trace's (None), then the user's
    changes; unknown keys and bad values are one-line errors."""
    assignments = list(args.assignments)
    if args.settings is not None:
        try:
            assignments = overrides_from_json(json.loads(args.settings.read_text())) + assignments
        except json.JSONDecodeError as exc:
            raise ValueError(f"{args.settings}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if args.budget_mib is not None:
        if args.budget_mib <= 0:
            raise ValueError(f"--budget-mib must be positive, got {args.budget_mib}")
        assignments.append(f"store.budget_bytes={int(args.budget_mib * 2**20)}")
    if args.as_recorded and not assignments:
        return None
    settings = trace.require_inputs().settings if args.as_recorded else Settings()
    for assignment in assignments:
        settings = override(settings, assignment)
    return settings


def settings_line(settings: Settings | None, trace: Trace, as_recorded: bool) -> str:
    """Which settings a replay ran: today's or the recorded ones, what the user changed,
    and how the recording's differ from today's."""
    if trace.settings_problem is not None:
        changed = differences(settings, Settings())
        return ("settings: today's engine defaults" + (f" with {', '.join(changed)}" if changed else "")
                + "; the recording's cannot be read (an older engine's)")
    recorded = trace.inputs.settings
    base = recorded if as_recorded else Settings()
    changed = differences(settings or base, base)
    line = "settings: as recorded" if as_recorded else "settings: today's engine defaults"
    line += f" with {', '.join(changed)}" if changed else ""
    apart = differences(Settings(), recorded)
    return line + (f"; today's differ from the recording's in {', '.join(apart)}" if apart else "")


def run_under_load(args: argparse.Namespace, trace: Trace, settings: Settings | None) -> int:
    """The batched mode: the policies at each load (``simulator.load_replay``)."""
    if args.timing is not None:
        raise ValueError("--timing is for batch-1 replays: a serving trace's steps are priced by its own serving grid")
    inputs = trace.decision_inputs(settings)
    names = policy_names(args.policy, trace, inputs)
    oracles = [name for name in names if name in ORACLES]
    if oracles and args.policy != "all":
        raise ValueError(f"{oracles[0]} replays at batch 1 only; under load give fixed policies, rakv, learned, "
                         f"{FORESIGHT} or {CAUSAL}")
    names = [name for name in names if name not in ORACLES] + ([FORESIGHT] if args.policy == "all" else [])
    title = f"{args.trace.name} under load\n{settings_line(settings, trace, args.as_recorded)}"
    return serve_loads(args, trace, inputs, names, title)


def run(args: argparse.Namespace) -> int:
    check_targets(args.itl_target, args.ttft_target)
    args.seed = None if args.seed is None else parse_seeds(args.seed, "--seed")
    trace = load_trace(args.trace)
    settings = replay_settings(args, trace)
    if has_serving_grid(trace):
        return run_under_load(args, trace, settings)
    given = [option for option, value in (("--concurrency", args.concurrency), ("--slo", args.slo),
                                          ("--max-num-seqs", args.max_num_seqs),
                                          ("--max-num-batched-tokens", args.max_num_batched_tokens),
                                          ("--max-num-prefills", args.max_num_prefills),
                                          ("--itl-target", args.itl_target),
                                          ("--ttft-target", args.ttft_target),
                                          ("--attainment", args.attainment))
             if value is not None]
    rates = args.arrival_rate.split(",") if args.arrival_rate is not None else [None]
    if given or len(rates) > 1:
        raise ValueError(f"{given[0] if given else 'a sweep of --arrival-rate values'} needs a serving trace, and "
                         f"{args.trace} holds no batched forwards (it replays at batch 1): record one under load "
                         f"with profiler.record --grid serving --serve-concurrency 1,2,4,8")
    timing = load_timing(args.timing, trace)
    names = policy_names(args.policy, trace, timing.decision_inputs(trace, settings))
    if FORESIGHT in names:
        raise ValueError(f"{FORESIGHT} replays under load only; at batch 1 the round oracle bounds the planners")
    if CAUSAL in names:
        raise ValueError(f"{CAUSAL} replays under load only; at batch 1 policy.evaluate reports the causal bound")
    try:  # one rate: checked by ``schedule``, as before sweeps
        rate = None if rates[0] is None else float(rates[0])
    except ValueError:
        raise ValueError(f"--arrival-rate: {rates[0]!r} is not a number") from None
    if args.seed is not None and len(args.seed) > 1:
        raise ValueError("several --seed values pool loads under load; at batch 1 give one")
    arrivals = schedule(trace, args.requests, rate, 0 if args.seed is None else args.seed[0])
    results = replay(trace, timing, names, arrivals, settings, args.strict)
    summaries = [summary for summary, _ in results.values()]
    if args.json:
        for summary in summaries:
            print(json.dumps(asdict(summary)))
    else:
        used = settings if settings is not None else trace.inputs.settings
        lines = [f"{args.trace.name}: {len(arrivals)} requests, timing from {timing.source}",
                 settings_line(settings, trace, args.as_recorded)]
        lines += [f"{s.policy}: its own controller settings, {', '.join(differences(s.settings, used))}"
                  for s in summaries if s.settings != used]
        print(markdown(summaries, "\n".join(lines)))
        gap = gap_line(summaries)
        if gap is not None:
            print("\n" + gap)
    if args.plot is not None:
        from simulator.plots import write_plots
        for path in write_plots(args.plot, results, timing, trace):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv),
                   (ValueError, TraceError, CostModelError, ScheduleError, SessionError, OSError))  # PolicyFileError: a ValueError


if __name__ == "__main__":
    sys.exit(main())
