"""Policies in tokens/s: every fixed policy, ``rakv`` and HF assisted generation over a
workload with shared prefixes, exact repeats and multi-turn follow-ups (section 4 of
``python -m bench.engine``).

    python -m bench.policies --pair tiny --quick
    python -m bench.policies --pair qwen-coder --workload code --policies ar,kv-only,joint-k4

Each contender has its own engine (and store); all advance in lockstep, request i going
through every contender in a rotating order. A follow-up request continues the contender's
own earlier prompt and output. Every output must equal the ``ar`` run's (plain greedy).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

from bench.harness import (Checks, bench_main, bench_parser, check_at_least_one, fresh_engine, hf_generate,
                           load_warm_pair, progress, report, timed)

HF_ASSISTED = "hf-assisted"

SYSTEM_PROMPTS = (
    "System: You are a careful assistant for an infrastructure team. Answer in two or three "
    "plain sentences, name concrete numbers when you know them, say so when you do not, and "
    "never invent command-line flags. The team runs language models on small CPU machines "
    "and cares about latency, memory and exact reproducibility of outputs.\n",
    "System: You are a patient tutor for first-year students. Explain one idea at a time, "
    "with a short everyday example, and end with a question that checks understanding.\n",
)
QUESTIONS = (
    "User: What does a KV cache store, and why does it grow with the context?\nAssistant:",
    "User: When does speculative decoding make generation slower?\nAssistant:",
    "User: How would you measure time to first token on a busy machine?\nAssistant:",
    "User: Why can greedy decoding be reproduced exactly while sampling cannot?\nAssistant:",
    "User: What is a hash function, in simple words?\nAssistant:",
    "User: Why do computers use binary numbers?\nAssistant:",
)
FOLLOW_UPS = (
    "\nUser: Can you give one concrete example of that?\nAssistant:",
    "\nUser: Thanks. What would you try first?\nAssistant:",
    "\nUser: Could you say that again more briefly?\nAssistant:",
)

CODE_SYSTEM = ("# You are an expert Python programmer. Complete each function with clear, "
               "correct, idiomatic code and a short docstring.\n\n")
CODE_PROMPTS = (
    "def is_prime(n: int) -> bool:\n",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n",
    "def parse_csv_line(line: str, sep: str = \",\") -> list[str]:\n",
    "def lru_cache_get(cache: dict, order: list, key):\n",
    "def flatten(nested: list) -> list:\n",
    "def word_counts(text: str) -> dict[str, int]:\n",
)
CODE_FOLLOW_UP = "\n# Now write a unit test for the function above.\ndef test_"


@dataclass(frozen=True)
class Request:
    text: str
    follow_up_of: int | None = None  # index of an earlier request: prompt + its output + text


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    requests: int
    generated_tokens: int
    wall_s: float
    mismatches: int  # requests whose output differs from the ar run's
    actions: str  # chosen (r, k) counts, e.g. "(1,0)x7 (1,4)x3 (1,4n)x2"; n: prompt lookup
    hit_kinds: str
    draft_acceptance: float | None  # accepted / proposed tokens over all rounds; None without rounds
    decide_s: tuple[float, ...]  # engine's lookup plus decision per request (empty for HF)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


@dataclass(frozen=True)
class PolicySection:
    pair: str
    max_new_tokens: int
    runs: tuple[PolicyRun, ...]
    clipped_prompts: int  # prompts cut to fit the model's positions (tiny pair only)
    best_fixed: str
    rakv_over_best_fixed: float
    rakv_over_hf_assisted: float | None


# -- workloads -----------------------------------------------------------------------
def chat_workload(short: bool) -> list[Request]:
    """12 requests: two system prompts with variants, exact repeats, multi-turn follow-ups."""
    a, b = SYSTEM_PROMPTS
    if short:  # byte-level tiny pair: 256 positions
        a, b = a.split(". ")[0] + ".\n", b.split(". ")[0] + ".\n"
    return [
        Request(a + QUESTIONS[0]), Request(a + QUESTIONS[1]), Request(a + QUESTIONS[2]),
        Request(a + QUESTIONS[0]),  # exact repeat
        Request(FOLLOW_UPS[0], follow_up_of=0),
        Request(a + QUESTIONS[3]),
        Request(a + QUESTIONS[1]),  # exact repeat
        Request(FOLLOW_UPS[1], follow_up_of=4),
        Request(b + QUESTIONS[4]), Request(b + QUESTIONS[5]),
        Request(a + QUESTIONS[2]),  # exact repeat
        Request(FOLLOW_UPS[2], follow_up_of=8),
    ]


def code_workload(num_prompts: int) -> list[Request]:
    """num_prompts code prompts with a shared header, a repeat of the first, a follow-up."""
    requests = [Request(CODE_SYSTEM + CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(num_prompts)]
    return requests + [Request(requests[0].text), Request(CODE_FOLLOW_UP, follow_up_of=0)]


def prompt_ids(pair, workload: list[Request], i: int, prompts: list, outputs: list, limit: int) -> tuple[list[int], bool]:
    """The prompt of request i (a follow-up uses the earlier request's prompt and output,
    as this run produced them), cut to ``limit`` tokens; and whether it was cut."""
    request = workload[i]
    if request.follow_up_of is None:
        ids = pair.encode(request.text)
    else:
        j = request.follow_up_of
        ids = prompts[j] + list(outputs[j]) + pair.encode_continuation(request.text)
    return ids[:limit], len(ids) > limit


# -- contenders ----------------------------------------------------------------------
@dataclass
class Runner:
    """One contender: its generate function and what it produced so far."""

    name: str
    generate: object  # prompt ids -> (output ids, RequestResult or None)
    prompts: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    results: list = field(default_factory=list)
    wall_s: float = 0.0
    clipped: int = 0


def engine_runner(pair, name: str, timings, max_new_tokens: int) -> Runner:
    engine = fresh_engine(pair, name, "full", timings if name == "rakv" else None)

    def generate(ids):
        result = engine.generate(ids, max_new_tokens)
        return result.output_ids, result
    return Runner(name, generate)


def hf_assisted_runner(pair, max_new_tokens: int) -> Runner:
    return Runner(HF_ASSISTED, lambda ids: (hf_generate(pair, ids, max_new_tokens, assisted=True), None))


def step(runner: Runner, pair, workload: list[Request], i: int, limit: int) -> None:
    """Run request i of the workload through ``runner`` (a follow-up is built from this
    runner's own earlier prompt and output)."""
    ids, cut = prompt_ids(pair, workload, i, runner.prompts, runner.outputs, limit)
    (output, result), seconds = timed(lambda: runner.generate(ids))
    runner.wall_s += seconds
    runner.clipped += cut
    runner.prompts.append(ids)
    runner.outputs.append(output)
    runner.results.append(result)


def action_label(action) -> str:
    """(r,k) for the draft model, (r,kn) for prompt lookup."""
    ngram = getattr(action, "drafter", "draft") == "ngram" and action.k > 0
    return f"({action.r},{action.k}{'n' if ngram else ''})"


def counts(items) -> str:
    return " ".join(f"{k}x{v}" for k, v in sorted(Counter(items).items()))


# -- the measurement -----------------------------------------------------------------
def bench_policies(pair, timings, workload: list[Request], policies: list[str], max_new_tokens: int,
                   hf_assisted: bool, checks: Checks, label: str) -> PolicySection:
    """Every contender keeps its own engine and store; they advance in lockstep, request i
    going through all of them in a rotating order, so that drift in the machine's load
    falls on all alike rather than on whichever ran last."""
    names = ["ar"] + [p for p in policies if p != "ar"] + ["rakv"]
    runners = [engine_runner(pair, name, timings, max_new_tokens) for name in names]
    if hf_assisted:
        runners.append(hf_assisted_runner(pair, max_new_tokens))
    limit = pair.max_positions - max_new_tokens - 1
    with progress(len(workload) * len(runners), f"4 policies {label}") as bar:
        for i in range(len(workload)):
            shift = i % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                bar.set_postfix_str(f"request {i + 1}/{len(workload)} {runner.name}")
                step(runner, pair, workload, i, limit)
                bar.update()
    reference = runners[0].outputs  # ar: plain greedy
    runs = [policy_run(r.name, r.outputs, reference, r.results if r.name != HF_ASSISTED else None,
                       r.wall_s, checks, label) for r in runners]
    fixed = [r for r in runs if r.policy not in ("rakv", HF_ASSISTED)]
    best = max(fixed, key=lambda r: r.tokens_per_s)
    rakv = next(r for r in runs if r.policy == "rakv")
    hf = next((r for r in runs if r.policy == HF_ASSISTED), None)
    return PolicySection(label, max_new_tokens, tuple(runs), runners[0].clipped, best.policy,
                         rakv.tokens_per_s / best.tokens_per_s,
                         None if hf is None else rakv.tokens_per_s / hf.tokens_per_s)


def policy_run(name, outputs, reference, results, wall_s, checks: Checks, label: str) -> PolicyRun:
    mismatches = sum(a != b for a, b in zip(outputs, reference))
    checks.expect(mismatches == 0, f"policies {label}: {name} differs from ar on {mismatches} of {len(outputs)} requests")
    actions = counts(action_label(r.action) for r in results) if results else ""
    kinds = counts(r.hit_kind for r in results) if results else ""
    decide = tuple(r.decide_s for r in results) if results else ()
    rounds = [rnd for r in results for rnd in r.rounds] if results else []
    drafted = sum(getattr(rnd, "num_proposed", rnd.k) for rnd in rounds)
    acceptance = sum(rnd.accepted for rnd in rounds) / drafted if drafted else None
    return PolicyRun(name, len(outputs), sum(len(o) for o in outputs), wall_s, mismatches, actions, kinds,
                     acceptance, decide)


def policy_section(pair, workload, policies, max_new_tokens, allow_hf_assisted: bool, checks,
                   label) -> PolicySection:
    """``bench_policies`` on the pair's calibrated timings; without a draft model, only the
    policies that need none, and no HF assisted generation."""
    from rakv.calibrate import load_or_calibrate
    from rakv.choices import fixed_action
    if pair.draft is None:  # keep what needs no draft model
        policies = [p for p in policies if fixed_action(p).k == 0 or getattr(fixed_action(p), "drafter", "") == "ngram"]
    timings = load_or_calibrate(pair)
    return bench_policies(pair, timings, workload, policies, max_new_tokens,
                          pair.draft is not None and allow_hf_assisted, checks, label)


def fixed_policy_list(p: argparse.ArgumentParser, option: str, value: str) -> list[str]:
    """The fixed policies of a comma-separated ``value`` ('all': every one); a name that is
    not a fixed policy is a usage error of ``option``."""
    from rakv.choices import fixed_action, fixed_policy_names
    names = list(fixed_policy_names()) if value == "all" else [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if fixed_action(n) is None]
    if bad:
        p.error(f"--{option.replace('_', '-')}: not fixed policies: {', '.join(bad)}")
    return names


# -- report --------------------------------------------------------------------------
def format_policies(pol: PolicySection) -> list[str]:
    ar = next(r for r in pol.runs if r.policy == "ar")
    lines = [f"4. Policies on {pol.pair}: {pol.runs[0].requests} requests, max_new_tokens="
             f"{pol.max_new_tokens}, a fresh engine each, run in lockstep"
             + (f" ({pol.clipped_prompts} prompts cut to fit)" if pol.clipped_prompts else ""),
             "   policy            tokens  wall_s    tok/s  vs_ar  mismatches  accept  actions (r,k; n: prompt lookup) | hits"]
    for r in pol.runs:
        detail = f"{r.actions} | {r.hit_kinds}" if r.actions else ""
        accept = "" if r.draft_acceptance is None else f"{r.draft_acceptance:.2f}"
        lines.append(f"   {r.policy:16s}  {r.generated_tokens:6d}  {r.wall_s:6.1f}  {r.tokens_per_s:7.2f}  "
                     f"{r.tokens_per_s / ar.tokens_per_s:5.2f}  {r.mismatches:10d}  {accept:>6}  {detail}")
    hf = "" if pol.rakv_over_hf_assisted is None else f", rakv / HF assisted {pol.rakv_over_hf_assisted:.3f}"
    lines.append(f"   rakv / best fixed ({pol.best_fixed}) {pol.rakv_over_best_fixed:.3f}{hf}")
    return lines


# -- on its own ----------------------------------------------------------------------
def run(args) -> int:
    checks = Checks()
    pair = load_warm_pair(args)
    workload = chat_workload(short=pair.max_positions < 1024) if args.workload == "chat" else code_workload(args.prompts)
    section = policy_section(pair, workload, args.policies, args.new_tokens, not args.no_hf_assisted, checks, args.pair)
    return report(format_policies(section), checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.policies",
                     "Every fixed policy, rakv and HF assisted generation in tokens/s over one workload, in lockstep.")
    p.add_argument("--workload", choices=("chat", "code"), default="chat",
                   help="chat: 12 requests under two system prompts; code: --prompts code prompts, a repeat and a "
                        "follow-up (default: chat)")
    p.add_argument("--prompts", type=int, default=3, help="code prompts of --workload code (default: 3)")
    p.add_argument("--new-tokens", type=int, default=None, help="max_new_tokens (default: 48, --quick: 12)")
    p.add_argument("--policies", default="all",
                   help="fixed policies, comma-separated, or 'all'; rakv and ar always run (default: all)")
    p.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation")
    args = p.parse_args(argv)
    check_at_least_one(p, args, "prompts", "new_tokens", "threads")
    if args.new_tokens is None:
        args.new_tokens = 12 if args.quick else 48
    args.policies = fixed_policy_list(p, "policies", args.policies)
    return bench_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
