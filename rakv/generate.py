"""Command line: run prompts through one engine (one shared prefix store), in order.

    python -m rakv.generate --pair tiny --policy rakv --max-new-tokens 64 "prompt"
    python -m rakv.generate --pair smollm2 --prompts prompts.jsonl --json

With no prompt it runs a built-in demo on the ``tiny`` pair that shows a cold start, a
partial hit, an exact repeat and a short prompt hitting a longer stored sequence.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from rakv.calibrate import RECALIBRATE_HELP
from rakv.cli import add_pair_arguments, run_cli
from rakv.choices import fixed_action
from rakv.controller import ControllerConfig
from rakv.drafters import NgramConfig
from rakv.engine import RequestError
from rakv.settings import EngineConfig
from rakv.store_model import StoreConfig
from rakv.models import PairError
from rakv.policies import check_policy, resolve_policy
from rakv.prompt_file import PromptLine, read_prompt_file

DEMO_PROMPTS = (
    "System: you answer in one line.\nUser: what does a KV cache store?",
    "System: you answer in one line.\nUser: why is greedy decoding deterministic?",
    "System: you answer in one line.\nUser: what does a KV cache store?",
    "System: you",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rakv.generate",
        description="Greedy generation with exact cross-request KV reuse and speculative decoding. "
                    "Output is token-identical to plain greedy decoding of the target under every policy.")
    p.add_argument("prompt", nargs="*", help="prompt text(s); none: a built-in demo")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="one prompt per line (\\n for a newline), or .jsonl with 'prompt' or 'prompt_ids' "
                        "and optionally 'max_new_tokens' per line; run in order through one engine")
    add_pair_arguments(p, default_pair="tiny")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    p.add_argument("--memory-limit-mib", type=float, default=None,
                   help="rakv: reject actions whose working KV exceeds this (default: no limit)")
    p.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default=None,
                   help="model dtype (default: float64 for tiny, float32 otherwise)")
    p.add_argument("--ngram-max", type=int, default=3, help="ngram drafter: longest n-gram searched (default: 3)")
    p.add_argument("--ngram-min", type=int, default=1, help="ngram drafter: shortest n-gram searched (default: 1)")
    p.add_argument("--recalibrate", action="store_true", help=RECALIBRATE_HELP)
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[PromptLine]:
    """The command line's prompts, then the prompts file's."""
    prompts = [PromptLine(0, text, None) for text in args.prompt]
    if args.prompts is not None:
        prompts += read_prompt_file(args.prompts)
    return prompts


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.store_budget_mib <= 0:
        raise ValueError(f"--store-budget-mib must be positive, got {args.store_budget_mib}")
    if args.memory_limit_mib is not None and args.memory_limit_mib <= 0:
        raise ValueError(f"--memory-limit-mib must be positive, got {args.memory_limit_mib}")
    check_policy(args.policy, args.pair)  # a bad name or policy file fails before any model loads
    prompts = read_prompts(args)
    demo = not prompts
    if demo:
        prompts = [PromptLine(0, text, None) for text in DEMO_PROMPTS]
    if any(p.prompt == "" for p in prompts):
        raise RequestError("empty prompt: nothing to condition on")

    from tqdm import tqdm
    from rakv.calibrate import load_or_calibrate
    from rakv.engine import Engine
    from rakv.models import load_pair

    pair = load_pair(args.pair, args.dtype, args.max_context, args.draft_layers, args.linear_kernels, args.weights)
    timings = load_or_calibrate(pair, refresh=args.recalibrate) if fixed_action(args.policy) is None else None
    limit = None if args.memory_limit_mib is None else int(args.memory_limit_mib * 2**20)
    controller = ControllerConfig(memory_limit_bytes=limit, store_drafter=not args.no_store_drafter)
    policy = resolve_policy(args.policy, timings, controller, pair.target_fingerprint, pair.draft_fingerprint,
                            args.pair, args.strict)
    ngram = NgramConfig(max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    engine = Engine(pair, policy, EngineConfig(StoreConfig(int(args.store_budget_mib * 2**20), args.store), ngram))
    requests = [(list(p.prompt_ids) if p.prompt_ids is not None else pair.encode(p.prompt),
                 p.max_new_tokens or args.max_new_tokens, p.line) for p in prompts]
    vocab = pair.target.config.vocab_size
    for ids, max_new, line in requests:  # reject bad input before spending any compute
        where = f"{args.prompts}:{line}: " if line else ""
        if max(ids, default=0) >= vocab:
            raise RequestError(f"{where}token id {max(ids)} is outside the vocabulary of {vocab}")
        try:
            engine.validate(ids, max_new)
        except RequestError as exc:
            raise RequestError(f"{where}{exc}") from None
    for ids, max_new, _ in tqdm(requests, desc="requests", unit="req", disable=len(requests) < 3, file=sys.stderr):
        result = engine.generate(ids, max_new)
        text = pair.decode(list(result.output_ids))
        if args.json:
            print(json.dumps({**result.to_json(), "text": text}), flush=True)
            continue
        num_out = len(result.output_ids)
        rounds = Counter(r.drafter for r in result.rounds)
        accepted = sum(r.accepted for r in result.rounds)
        proposed = sum(r.num_proposed for r in result.rounds)
        spec = "".join(f" {d}-rounds={c}" for d, c in sorted(rounds.items()))
        spec += f" accepted={accepted}/{proposed}" if rounds else ""
        print(f"[{result.request_id}] {result.policy} {result.action} {result.hit_kind} "
              f"hit={result.hit_tokens}/{result.num_prompt_tokens} ttft={result.ttft_s * 1e3:.1f}ms "
              f"{num_out / result.e2e_s:.1f} tok/s{spec}", file=sys.stderr)
        print(repr(text) if demo else text, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, PairError, RequestError, OSError))


if __name__ == "__main__":
    sys.exit(main())
