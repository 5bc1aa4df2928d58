"""The store drafter, live: tokens/s of ``rakv`` with it, ``rakv`` without it
(``controller.store_drafter=false``), plain greedy ``ar`` and fixed policies, over a
workload's requests in lockstep.

    python -m bench.store_drafter --pair qwen-coder --workload code-repeat --requests 24
    python -m bench.store_drafter --pair tiny --workload fixture-chat --max-new-tokens 8

Each contender has its own engine and store, and every request goes through every
contender (in a rotating order) before the next request, so drift in the machine's load
falls on all of them alike; a later turn continues the earlier turn's prompt and greedy
output, as ``profiler.record`` builds it. Every output must equal ``ar``'s (plain
greedy); a mismatch makes the exit status 1. Prints tokens/s (prompt included, as a user
waits for it), the ratios to ``ar`` and to ``rakv`` without the store drafter, and the
rounds each drafter made. One torch thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from rakv.cli import add_precision_arguments, run_cli

WITHOUT = "rakv-no-store"  # rakv with controller.store_drafter=false


@dataclass
class Tally:
    generated_tokens: int = 0
    wall_s: float = 0.0
    mismatches: int = 0
    rounds: Counter = field(default_factory=Counter)  # drafter -> rounds
    accepted: Counter = field(default_factory=Counter)  # drafter -> accepted tokens

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


def engines(pair, names: list[str], timings, settings):
    from rakv.controller import make_policy
    from rakv.engine import Engine
    built = {}
    for name in names:
        controller = replace(settings.controller, store_drafter=False) if name == WITHOUT else settings.controller
        policy = make_policy("rakv" if name == WITHOUT else name, timings, controller)
        built[name] = Engine(pair, policy, settings.engine)
    return built


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from profiler.record import prompt_ids
    from profiler.workloads import load_workload
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    from rakv.settings import Settings

    torch.set_num_threads(1)  # one torch thread per process, as every benchmark here
    names = ["ar", *[n.strip() for n in args.fixed.split(",") if n.strip()], WITHOUT, "rakv"]
    workload = load_workload(args.workload, args.requests)
    pair = load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights)
    timings = load_or_calibrate(pair)
    contenders = engines(pair, names, timings, Settings())
    tallies = {name: Tally() for name in names}
    done: dict[int, SimpleNamespace] = {}  # request id -> its prompt and greedy output, for later turns
    bar = tqdm(total=len(workload.requests) * len(names), desc="runs", unit="run", file=sys.stderr, leave=False)
    for i, request in enumerate(workload.requests):
        max_new = args.max_new_tokens or request.max_new_tokens
        prompt = prompt_ids(pair, request, max_new, done)
        outputs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotating order
            result = contenders[name].generate(prompt, max_new)
            tally = tallies[name]
            tally.generated_tokens += len(result.output_ids)
            tally.wall_s += result.e2e_s
            for rnd in result.rounds:
                tally.rounds[rnd.drafter] += 1
                tally.accepted[rnd.drafter] += rnd.accepted
            outputs[name] = list(result.output_ids)
            bar.update()
        for name in names:
            tallies[name].mismatches += outputs[name] != outputs["ar"]
        done[request.request_id] = SimpleNamespace(prompt_ids=prompt, output_ids=outputs["ar"])
    bar.close()
    print(report(args, tallies))
    if args.json:
        args.json.write_text(json.dumps({name: {"generated_tokens": t.generated_tokens, "wall_s": t.wall_s,
                                                "mismatches": t.mismatches, "tokens_per_s": t.tokens_per_s,
                                                "rounds": dict(t.rounds), "accepted": dict(t.accepted)}
                                         for name, t in tallies.items()}, indent=1))
    return 1 if any(t.mismatches for t in tallies.values()) else 0


def report(args, tallies: dict[str, Tally]) -> str:
    ar, without = tallies["ar"].tokens_per_s, tallies[WITHOUT].tokens_per_s
    lines = [f"{args.workload}, {args.pair}: {len(tallies)} contenders in lockstep",
             f"{'policy':16} {'tok/s':>7} {'vs ar':>6} {'vs no-store':>11} {'mism':>4}  rounds (accepted tokens)"]
    for name, t in tallies.items():
        rounds = " ".join(f"{d}:{n} ({t.accepted[d]})" for d, n in sorted(t.rounds.items()))
        lines.append(f"{name:16} {t.tokens_per_s:7.2f} {t.tokens_per_s / ar:6.2f} {t.tokens_per_s / without:11.2f} "
                     f"{t.mismatches:4}  {rounds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", help="model pair (default: smollm2)")
    add_precision_arguments(p)
    p.add_argument("--workload", default="code-repeat", help="a profiler workload (default: code-repeat)")
    p.add_argument("--requests", type=int, default=None, help="its first N requests (default: the workload's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap per request (default: the workload's)")
    p.add_argument("--fixed", default="spec-k4,ngram-k4", help="fixed policies beside ar (default: spec-k4,ngram-k4)")
    p.add_argument("--json", type=Path, default=None, help="also write the tallies as JSON")
    return run_cli(run, p.parse_args(argv), (ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
