"""Engine benchmark: ratios measured in one run, on the machine at hand.

    python -m bench.engine                      # smollm2, then qwen-coder (3 prompts)
    python -m bench.engine --skip-qwen --json bench.json
    python -m bench.engine --pair tiny --quick --skip-qwen   # under a minute, a smoke test
    python -m bench.engine --threads 1          # steadier when other processes share the CPU

Sections (every figure comes from this run; nothing is hard-coded):
1. exact-repeat TTFT / cold TTFT (kv-only engine, each prompt cold then repeated);
2. partial-hit TTFT against the uncached length |U| at two total prompt lengths
   (kv-only, ``--store prompt``, a fresh store per point, reused tokens checked);
3. engine ``ar`` seconds per decoded token / Hugging Face ``generate`` seconds per token
   (same prompts, same max_new_tokens, outputs checked identical);
4. tokens/s of every fixed policy, ``rakv`` and HF assisted generation over a workload with
   shared prefixes, exact repeats and multi-turn follow-ups, each with its own engine, all
   advancing in lockstep (request i through every contender in a rotating order); then
   ar, a few fixed policies, rakv and HF assisted on qwen-coder;
5. the controller's decision overhead: ``policy.decide`` per call, and the engine's
   ``decide_s`` (lookup plus decision) per request.

Prompt lookup (``ar``, ``ngram-k4`` and ``rakv`` against HF ``prompt_lookup_num_tokens`` on
code, chat revisions and prose) has its own script: ``python -m bench.prompt_lookup``.

Progress goes to stderr; the tables go to stdout at the end. A failed check (a repeat
that was not exact, a reused count that differs from the one expected, an output that
differs from plain greedy) is printed and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rakv.cli import run_cli
from rakv.controller import FIXED_POLICIES
from rakv.models import LINEAR_KERNELS, LINEAR_KERNELS_HELP

QWEN_DEFAULT_POLICIES = "ar,kv-only,joint-k2,joint-k4,joint-ngram-k4"
HF_ASSISTED = "hf-assisted"

PARAGRAPHS = (
    "A key-value cache keeps the attention keys and values of every token a transformer has "
    "already read, so that generating the next token costs one forward pass over one token "
    "instead of a pass over the whole sequence. Its size grows linearly with the context.",
    "Serving systems see the same prefixes again and again: a system prompt shared by every "
    "user, a few-shot template, a document that several questions refer to, or the earlier "
    "turns of a conversation. Reusing their cached state skips the prefill of those tokens.",
    "Speculative decoding lets a small draft model propose several tokens that the large "
    "model then checks in a single forward pass. With greedy decoding the accepted prefix is "
    "exactly what the large model would have produced alone, so the output does not change.",
    "Whether speculation pays depends on how often the draft agrees with the target, on the "
    "relative cost of the two models, and on the length of the context; on a small CPU the "
    "verification of many tokens is not free, and a poor draft only adds work.",
    "The controller prices each action from measured timings: the cost of a prefill of a "
    "given length, of one decoding step, of a verification of k plus one tokens, and of "
    "copying stored state. It then picks the cheapest action that fits the memory limit.",
    "Exact prefix matching hashes the first sixteen tokens to find candidate entries and then "
    "compares token ids, so a collision can only cost a miss, never a wrong answer. Entries "
    "are evicted in least-recently-used order when the byte budget is exceeded.",
)

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


# -- results -------------------------------------------------------------------------
@dataclass(frozen=True)
class RepeatPoint:
    prompt_tokens: int
    cold_ttft_s: float
    repeat_ttft_s: float
    cold_hit_kind: str
    repeat_hit_kind: str

    @property
    def ratio(self) -> float:
        return self.repeat_ttft_s / self.cold_ttft_s


@dataclass(frozen=True)
class RepeatSection:
    points: tuple[RepeatPoint, ...]
    median_ratio: float


@dataclass(frozen=True)
class PartialPoint:
    total_tokens: int
    uncached_tokens: int
    expected_reused_tokens: int
    reused_tokens: int
    hit_kind: str
    hit_ttft_s: float  # median over repeats
    cold_ttft_s: float  # median over repeats, same prompt, empty store


@dataclass(frozen=True)
class PartialSection:
    points: tuple[PartialPoint, ...]
    repeats: int


@dataclass(frozen=True)
class DecodePoint:
    prompt_tokens: int
    engine_tokens: int
    engine_ttft_s: float
    engine_e2e_s: float
    hf_tokens: int
    hf_ttft_s: float
    hf_e2e_s: float
    identical: bool

    @property
    def engine_per_token_s(self) -> float:
        return (self.engine_e2e_s - self.engine_ttft_s) / max(self.engine_tokens - 1, 1)

    @property
    def hf_per_token_s(self) -> float:
        return (self.hf_e2e_s - self.hf_ttft_s) / max(self.hf_tokens - 1, 1)


@dataclass(frozen=True)
class DecodeSection:
    max_new_tokens: int
    points: tuple[DecodePoint, ...]
    median_ratio: float  # median over prompts of engine / HF seconds per token
    pooled_ratio: float  # total engine decode seconds per token / total HF


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


@dataclass(frozen=True)
class DecideSection:
    calls: int
    decide_us_per_call: float
    engine_decide_us_median: float
    engine_decide_requests: int


@dataclass
class Checks:
    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)
            print(f"CHECK FAILED: {message}", file=sys.stderr)


# -- helpers -------------------------------------------------------------------------
def progress(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, leave=False)


def long_ids(pair, num_tokens: int, tag: str) -> list[int]:
    """The first ``num_tokens`` ids of a long technical text starting with ``tag``."""
    text, k = tag, 0
    while True:
        ids = pair.encode(text)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        text += f"Part {k + 1}. {PARAGRAPHS[k % len(PARAGRAPHS)]}\n"
        k += 1


def spread(low: int, high: int, count: int) -> list[int]:
    if count == 1:
        return [high]
    return [round(low + (high - low) * i / (count - 1)) for i in range(count)]


def fresh_engine(pair, policy_name: str, store_mode: str = "full", timings=None):
    from rakv.controller import make_policy
    from rakv.engine import Engine
    from rakv.settings import EngineConfig
    from rakv.store_model import StoreConfig
    return Engine(pair, make_policy(policy_name, timings), EngineConfig(StoreConfig(mode=store_mode)))


def hf_generate(pair, prompt: list[int], max_new_tokens: int, assisted: bool = False,
                **generate_kwargs) -> tuple[int, ...]:
    """Greedy Hugging Face ``generate`` on the target (with the draft as assistant model
    when ``assisted``); further keyword arguments go to ``generate``. Returns the new ids."""
    import torch
    ids = torch.tensor([prompt], dtype=torch.long, device=pair.target.device)
    if assisted:
        generate_kwargs["assistant_model"] = pair.draft
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens, **generate_kwargs)
    return tuple(out[0, len(prompt):].tolist())


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def warm_up(pair) -> None:
    """First forwards are slow (lazy init, allocator); run each code path once."""
    ids = long_ids(pair, 48, "Warm-up. ")
    fresh_engine(pair, "ar", "off").generate(ids, 4)
    hf_generate(pair, ids, 4)
    if pair.draft is not None:
        fresh_engine(pair, "spec-k2", "off").generate(ids, 4)
        hf_generate(pair, ids, 4, assisted=True)


# -- 1. exact repeats ----------------------------------------------------------------
def bench_exact_repeat(pair, num_prompts: int, checks: Checks) -> RepeatSection:
    engine = fresh_engine(pair, "kv-only")
    high = min(768, int(pair.max_positions * 0.6))
    points = []
    with progress(num_prompts, "1 exact repeat") as bar:
        for i, length in enumerate(spread(min(32, high), high, num_prompts)):
            ids = long_ids(pair, length, f"Document {i + 1}. ")
            cold = engine.generate(ids, 4)
            repeat = engine.generate(ids, 4)
            checks.expect(cold.hit_kind == "miss", f"exact-repeat prompt {i}: cold run was {cold.hit_kind}")
            checks.expect(repeat.hit_kind == "exact", f"exact-repeat prompt {i}: repeat was {repeat.hit_kind}")
            checks.expect(repeat.output_ids == cold.output_ids, f"exact-repeat prompt {i}: output changed")
            points.append(RepeatPoint(length, cold.ttft_s, repeat.ttft_s, cold.hit_kind, repeat.hit_kind))
            bar.update()
    return RepeatSection(tuple(points), statistics.median(p.ratio for p in points))


# -- 2. partial hits -----------------------------------------------------------------
def partial_lengths(pair, quick: bool) -> tuple[list[int], list[int]]:
    """(total prompt lengths, uncached lengths), scaled down for small models."""
    totals = [300, 600]
    if totals[-1] + 2 > pair.max_positions:
        totals = [pair.max_positions * 3 // 8, pair.max_positions * 3 // 4]
    uncached = [16, 64] if quick else [16, 64, 128, 256]
    uncached = [u for u in uncached if u <= totals[0] - 16]  # the prefix keeps >= 16 tokens
    return totals, uncached


def bench_partial_hits(pair, quick: bool, repeats: int, checks: Checks) -> PartialSection:
    totals, uncached = partial_lengths(pair, quick)
    ids = long_ids(pair, max(totals), "Report. ")
    hit_s = {(t, u): [] for t in totals for u in uncached}
    cold_s = {t: [] for t in totals}
    seen = {}
    with progress(repeats * len(totals) * (len(uncached) + 1), "2 partial hits") as bar:
        for _ in range(repeats):
            for total in totals:
                prompt = ids[:total]
                cold = fresh_engine(pair, "kv-only", "prompt").generate(prompt, 1)
                checks.expect(cold.hit_kind == "miss", f"partial: cold {total} was {cold.hit_kind}")
                cold_s[total].append(cold.ttft_s)
                bar.update()
                for u in uncached:
                    engine = fresh_engine(pair, "kv-only", "prompt")
                    engine.generate(prompt[:total - u], 1)  # store P
                    result = engine.generate(prompt, 1)  # P + U
                    checks.expect(result.reused_tokens == total - u,
                                  f"partial: total {total} |U|={u} reused {result.reused_tokens}, expected {total - u}")
                    checks.expect(result.output_ids == cold.output_ids, f"partial: total {total} |U|={u} output differs")
                    hit_s[(total, u)].append(result.ttft_s)
                    seen[(total, u)] = (result.reused_tokens, result.hit_kind)
                    bar.update()
    points = tuple(
        PartialPoint(t, u, t - u, seen[(t, u)][0], seen[(t, u)][1],
                     statistics.median(hit_s[(t, u)]), statistics.median(cold_s[t]))
        for t in totals for u in uncached)
    return PartialSection(points, repeats)


# -- 3. engine ar vs HF generate -----------------------------------------------------
def bench_decode(pair, num_prompts: int, max_new_tokens: int, checks: Checks) -> DecodeSection:
    engine = fresh_engine(pair, "ar", "off")
    high = min(256, pair.max_positions - max_new_tokens - 1)
    points = []
    with progress(num_prompts, "3 ar vs HF") as bar:
        for i, length in enumerate(spread(min(32, high), high, num_prompts)):
            ids = long_ids(pair, length, f"Notes {i + 1}. ")

            def run_engine():
                return engine.generate(ids, max_new_tokens)

            def run_hf():
                _, ttft = timed(lambda: hf_generate(pair, ids, 1))
                out, e2e = timed(lambda: hf_generate(pair, ids, max_new_tokens))
                return out, ttft, e2e

            if i % 2 == 0:  # alternate the order to spread drift and noise
                result, (hf_out, hf_ttft, hf_e2e) = run_engine(), run_hf()
            else:
                (hf_out, hf_ttft, hf_e2e), result = run_hf(), run_engine()
            identical = hf_out == result.output_ids
            checks.expect(identical, f"ar vs HF: prompt {i} ({length} tokens) outputs differ")
            checks.expect(len(result.output_ids) > 1, f"ar vs HF: prompt {i} gave one token only")
            points.append(DecodePoint(length, len(result.output_ids), result.ttft_s, result.e2e_s,
                                      len(hf_out), hf_ttft, hf_e2e, identical))
            bar.update()
    usable = [p for p in points if p.engine_tokens > 1 and p.hf_tokens > 1]
    median_ratio = statistics.median(p.engine_per_token_s / p.hf_per_token_s for p in usable)
    engine_total = sum(p.engine_e2e_s - p.engine_ttft_s for p in usable) / sum(p.engine_tokens - 1 for p in usable)
    hf_total = sum(p.hf_e2e_s - p.hf_ttft_s for p in usable) / sum(p.hf_tokens - 1 for p in usable)
    return DecodeSection(max_new_tokens, tuple(points), median_ratio, engine_total / hf_total)


# -- 4. policies ---------------------------------------------------------------------
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


@dataclass
class Runner:
    """One contender of section 4: its generate function and what it produced so far."""

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


# -- 5. decision overhead ------------------------------------------------------------
def bench_decide(timings, num_calls: int, engine_decide_s: list[float]) -> DecideSection:
    from rakv.controller import CostModelPolicy
    from rakv.cost_model import RequestFeatures
    rng = random.Random(0)
    features = []
    for _ in range(num_calls):
        n = rng.randint(1, 4000)
        hit = rng.choice((0, rng.randint(0, n), n))
        features.append(RequestFeatures(
            num_prompt_tokens=n, num_new_tokens=rng.randint(1, 512), target_hit_tokens=hit,
            draft_hit_tokens=rng.choice((0, hit)), exact_repeat=hit == n and rng.random() < 0.5,
            acceptance=rng.random()))
    policy = CostModelPolicy(timings)
    for f in features[:100]:  # warm-up
        policy.decide(f)
    start = time.perf_counter()
    for f in features:
        policy.decide(f)
    per_call_us = (time.perf_counter() - start) / num_calls * 1e6
    median_us = statistics.median(engine_decide_s) * 1e6 if engine_decide_s else float("nan")
    return DecideSection(num_calls, per_call_us, median_us, len(engine_decide_s))


# -- report --------------------------------------------------------------------------
def ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def format_report(pair_name: str, sections: dict, checks: Checks, wall_s: float,
                  load: tuple[float, float]) -> str:
    import torch
    cores = os.cpu_count() or 1
    lines = [f"RAKV engine benchmark: pair {pair_name}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {cores} cores, {wall_s:.0f} s, "
             f"1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end"]
    if max(load) > cores - 0.5:
        hint = " (try --threads 1)" if torch.get_num_threads() > 1 else ""
        lines.append(f"   WARNING: other processes were using the CPU; timings are noisy{hint}")
    rep: RepeatSection = sections["exact_repeat"]
    lines += ["", f"1. Exact-repeat TTFT / cold TTFT (kv-only, {len(rep.points)} prompts, each cold then repeated)",
              "   prompt_tok  cold_ttft_ms  repeat_ttft_ms   ratio  kinds"]
    for p in rep.points:
        lines.append(f"   {p.prompt_tokens:10d}  {ms(p.cold_ttft_s):>12}  {ms(p.repeat_ttft_s):>14}  "
                     f"{p.ratio:6.4f}  {p.cold_hit_kind}/{p.repeat_hit_kind}")
    lines.append(f"   median ratio {rep.median_ratio:.4f}")

    par: PartialSection = sections["partial_hits"]
    lines += ["", f"2. Partial-hit TTFT vs uncached length (kv-only, --store prompt, fresh store per point, "
                  f"median of {par.repeats}, max_new_tokens=1)",
              "   total_tok  uncached_tok  reused_tok  kind      hit_ttft_ms  cold_ttft_ms  hit/cold"]
    for p in par.points:
        lines.append(f"   {p.total_tokens:9d}  {p.uncached_tokens:12d}  {p.reused_tokens:10d}  {p.hit_kind:8s}  "
                     f"{ms(p.hit_ttft_s):>11}  {ms(p.cold_ttft_s):>12}  {p.hit_ttft_s / p.cold_ttft_s:8.3f}")
    by_u = {}
    for p in par.points:
        by_u.setdefault(p.uncached_tokens, []).append(p)
    lines.append("   same |U| across totals, hit TTFT long/short: " + ", ".join(
        f"|U|={u}: {ps[-1].hit_ttft_s / ps[0].hit_ttft_s:.2f}" for u, ps in by_u.items() if len(ps) > 1))

    dec: DecodeSection = sections["decode"]
    lines += ["", f"3. Engine ar / HF generate, seconds per decoded token (store off, max_new_tokens="
                  f"{dec.max_new_tokens}, (e2e - ttft) / (tokens - 1))",
              "   prompt_tok  tokens  engine_ms/tok  hf_ms/tok   ratio  engine_ttft_ms  hf_ttft_ms  identical"]
    for p in dec.points:
        ratio = p.engine_per_token_s / p.hf_per_token_s
        lines.append(f"   {p.prompt_tokens:10d}  {p.engine_tokens:6d}  {ms(p.engine_per_token_s):>13}  "
                     f"{ms(p.hf_per_token_s):>9}  {ratio:6.3f}  {ms(p.engine_ttft_s):>14}  {ms(p.hf_ttft_s):>10}  "
                     f"{p.identical}")
    lines.append(f"   median ratio {dec.median_ratio:.3f} (pooled {dec.pooled_ratio:.3f}; goal <= 1.05)")

    for key in ("policies", "policies_qwen"):
        pol: PolicySection | None = sections.get(key)
        if pol is None:
            continue
        ar = next(r for r in pol.runs if r.policy == "ar")
        lines += ["", f"4. Policies on {pol.pair}: {pol.runs[0].requests} requests, max_new_tokens="
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

    dcs: DecideSection = sections["decide"]
    lines += ["", "5. Controller decision overhead",
              f"   CostModelPolicy.decide: {dcs.decide_us_per_call:.1f} us per call over {dcs.calls} calls (goal <= 100 us)",
              f"   engine decide_s (lookup + decide), median over {dcs.engine_decide_requests} rakv requests: "
              f"{dcs.engine_decide_us_median:.1f} us"]

    lines += ["", "Summary (ratios from this run)",
              f"   exact-repeat TTFT / cold TTFT            {rep.median_ratio:8.4f}  median of {len(rep.points)}",
              f"   engine ar / HF generate, s per token     {dec.median_ratio:8.3f}  goal <= 1.05"]
    for key in ("policies", "policies_qwen"):
        pol = sections.get(key)
        if pol is not None:
            lines.append(f"   rakv / best fixed on {pol.pair:18s}  {pol.rakv_over_best_fixed:8.3f}  best fixed: {pol.best_fixed}")
            if pol.rakv_over_hf_assisted is not None:
                lines.append(f"   rakv / HF assisted on {pol.pair:17s}  {pol.rakv_over_hf_assisted:8.3f}")
    lines += [f"   decide() per call, us                    {dcs.decide_us_per_call:8.1f}  goal <= 100",
              f"   checks failed                            {len(checks.failures):8d}"]
    lines += [f"   FAILED: {f}" for f in checks.failures]
    return "\n".join(lines)


def to_json(section) -> dict:
    row = asdict(section)
    if isinstance(section, RepeatSection):
        for p, point in zip(row["points"], section.points):
            p["ratio"] = point.ratio
    if isinstance(section, DecodeSection):
        for p, point in zip(row["points"], section.points):
            p["engine_per_token_s"], p["hf_per_token_s"] = point.engine_per_token_s, point.hf_per_token_s
    if isinstance(section, PolicySection):
        for p, run in zip(row["runs"], section.runs):
            p["tokens_per_s"] = run.tokens_per_s
    return row


# -- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="Benchmark the engine: exact-repeat and partial-hit TTFT, decode speed against "
                    "Hugging Face generate, policies in tokens/s (against HF assisted generation), and "
                    "the controller's overhead. Prints ratios measured in this run.")
    p.add_argument("--pair", default="smollm2", help="model pair for sections 1-5 (default: smollm2)")
    p.add_argument("--linear-kernels", choices=LINEAR_KERNELS, default="auto", help=LINEAR_KERNELS_HELP)
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats (a smoke test)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="max_new_tokens in sections 3 and 4 (default: 48, --quick: 12)")
    p.add_argument("--policies", default="all",
                   help="fixed policies of section 4, comma-separated, or 'all' (ar, kv-only, spec-kN, joint-kN, "
                        "ngram-kN, joint-ngram-kN for N in 1, 2, 4, 6, 8); rakv and ar always run (default: all)")
    p.add_argument("--skip-qwen", action="store_true", help="skip the qwen-coder part of section 4")
    p.add_argument("--qwen-prompts", type=int, default=3,
                   help="code prompts for qwen-coder (default: 3; the workload adds a repeat and a follow-up)")
    p.add_argument("--qwen-new-tokens", type=int, default=32, help="max_new_tokens on qwen-coder (default: 32)")
    p.add_argument("--qwen-policies", default=QWEN_DEFAULT_POLICIES,
                   help=f"fixed policies on qwen-coder (default: {QWEN_DEFAULT_POLICIES}); rakv and ar always run")
    p.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation in section 4")
    p.add_argument("--decide-calls", type=int, default=10_000, help="policy.decide calls timed (default: 10000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); on a shared, busy machine 1 is far steadier")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every figure as JSON to FILE")
    args = p.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 12 if args.quick else 48
    for name in ("new_tokens", "qwen_prompts", "qwen_new_tokens", "decide_calls", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from rakv.controller import fixed_action
    for option in ("policies", "qwen_policies"):
        value = getattr(args, option)
        names = list(FIXED_POLICIES) if value == "all" else [n.strip() for n in value.split(",") if n.strip()]
        bad = [n for n in names if fixed_action(n) is None]
        if bad:
            p.error(f"--{option.replace('_', '-')}: not fixed policies: {', '.join(bad)}")
        setattr(args, option, names)
    return args


def policy_section(pair, workload, policies, max_new_tokens, args, checks, label) -> PolicySection:
    from rakv.calibrate import load_or_calibrate
    from rakv.controller import fixed_action
    if pair.draft is None:  # keep what needs no draft model
        policies = [p for p in policies if fixed_action(p).k == 0 or getattr(fixed_action(p), "drafter", "") == "ngram"]
    timings = load_or_calibrate(pair)
    return bench_policies(pair, timings, workload, policies, max_new_tokens,
                          pair.draft is not None and not args.no_hf_assisted, checks, label)


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    transformers.logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    load_start = os.getloadavg()[0]
    checks = Checks()
    sections: dict = {}
    print(f"loading {args.pair}", file=sys.stderr)
    pair = load_pair(args.pair, linear_kernels=args.linear_kernels)
    timings = load_or_calibrate(pair)
    warm_up(pair)
    sections["exact_repeat"] = bench_exact_repeat(pair, 3 if args.quick else 8, checks)
    sections["partial_hits"] = bench_partial_hits(pair, args.quick, 1 if args.quick else 3, checks)
    sections["decode"] = bench_decode(pair, 2 if args.quick else 6, args.new_tokens, checks)
    workload = chat_workload(short=pair.max_positions < 1024)
    sections["policies"] = policy_section(pair, workload, args.policies, args.new_tokens, args, checks, args.pair)
    rakv_run = next(r for r in sections["policies"].runs if r.policy == "rakv")
    sections["decide"] = bench_decide(timings, args.decide_calls, list(rakv_run.decide_s))
    if not args.skip_qwen and args.pair != "qwen-coder":
        del pair
        gc.collect()
        print("loading qwen-coder (the first load converts the GGUF files: minutes)", file=sys.stderr)
        qwen = load_pair("qwen-coder", linear_kernels=args.linear_kernels)
        warm_up(qwen)
        sections["policies_qwen"] = policy_section(qwen, code_workload(args.qwen_prompts), args.qwen_policies,
                                                   args.qwen_new_tokens, args, checks, "qwen-coder")
    wall_s = time.perf_counter() - start
    load = (load_start, os.getloadavg()[0])
    print(format_report(args.pair, sections, checks, wall_s, load), flush=True)
    if args.json is not None:
        figures = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "wall_s": wall_s, "load_average_1min": load, "torch_threads": torch.get_num_threads(),
                   "checks_failed": checks.failures,
                   **{name: to_json(section) for name, section in sections.items()}}
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures written to {args.json}", file=sys.stderr)
    return 1 if checks.failures else 0


def main(argv: list[str] | None = None) -> int:
    from rakv.models import PairError
    return run_cli(run, parse_args(argv), (PairError, OSError))


if __name__ == "__main__":
    sys.exit(main())
