"""The engine benchmarks' harness: fresh engines, the Hugging Face reference, timing,
progress bars, checks, and the pair loading and reporting of a bench run on its own.

Every measurement module (``bench.repeat``, ``bench.partial``, ``bench.decode``,
``bench.policies``, ``bench.decide``) and the speculation benches (``bench.assisted``,
``bench.prompt_lookup``) run their contenders through these, so an engine, an HF call and
a check mean the same in every table. Importing this module loads no torch (the command
lines parse their arguments first).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field

from rakv.cli import add_precision_arguments

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


@dataclass
class Checks:
    """The failed checks of a run (a repeat that was not exact, an output that differs from
    plain greedy, ...): each is printed when it fails, and any makes the exit status 1."""

    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)
            print(f"CHECK FAILED: {message}", file=sys.stderr)


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


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


# -- one measurement on its own (python -m bench.repeat, ...) --------------------------
def bench_parser(prog: str, description: str, quick: bool = True) -> argparse.ArgumentParser:
    """The options every measurement module takes when it runs on its own (``quick``:
    with ``--quick``, for those whose size it scales)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--pair", default="smollm2", help="model pair (default: smollm2)")
    add_precision_arguments(p)
    if quick:
        p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats (a smoke test)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); on a shared, busy machine 1 is far steadier")
    return p


def check_at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def configure_torch(threads: int | None) -> None:
    """Quiet transformers' warnings; ``threads`` torch CPU threads (None: torch's choice)."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    if threads is not None:
        torch.set_num_threads(threads)


def load_warm_pair(args: argparse.Namespace):
    """``args.pair`` on ``args.linear_kernels``, warmed up, after ``configure_torch``."""
    from rakv.models import load_pair
    configure_torch(args.threads)
    print(f"loading {args.pair}", file=sys.stderr)
    pair = load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights)
    warm_up(pair)
    return pair


def report(lines: list[str], checks: Checks) -> int:
    """Print a measurement's table and its failed checks; the exit status (1: a check failed)."""
    lines = lines + [f"   checks failed {len(checks.failures)}"] + [f"   FAILED: {f}" for f in checks.failures]
    print("\n".join(lines), flush=True)
    return 1 if checks.failures else 0


def bench_main(run, args: argparse.Namespace) -> int:
    """``run(args)`` under the project's command-line contract (``rakv.cli``)."""
    from rakv.cli import run_cli
    from rakv.models import PairError
    return run_cli(run, args, (PairError, OSError))


def with_derived(section, items: str, *properties: str) -> dict:
    """``asdict(section)``, each entry of its list ``items`` with the values of the
    ``properties`` its element derives (``asdict`` leaves properties out)."""
    row = asdict(section)
    for entry, element in zip(row[items], getattr(section, items)):
        entry.update({name: getattr(element, name) for name in properties})
    return row
