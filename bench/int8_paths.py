"""int8 layers on the project's C kernel against oneDNN's int8 path: the same bits
(tests/test_weights.py), so this measures speed alone.

    python -m bench.int8_paths                          # qwen-coder in int8: target and draft
    python -m bench.int8_paths --weights int4 --repeat 7   # int4 (its 5-8 bit layers run as int8)

One torch thread. The pair is loaded twice, once per path; for each T the two alternate
(lockstep), each figure the median of ``--repeat`` forwards over the same 300 cached
tokens, rolled back after each. Prints ms per forward over T tokens and the C kernel's
time over oneDNN's.
"""
from __future__ import annotations

import argparse
import sys
from unittest import mock

from bench.step import TOKENS, cached, lockstep_ms

CONTEXT = 300


def bench(pair_name: str, mode: str, repeat: int) -> list[str]:
    import torch
    torch.set_num_threads(1)
    from rakv import int4
    from rakv.models import load_pair
    pairs = {"c": load_pair(pair_name, weights_mode=mode)}
    with mock.patch.object(int4, "kernel_or_none", lambda: None):  # Int8Forward's no-compiler path
        pairs["onednn"] = load_pair(pair_name, weights_mode=mode)
    lines = []
    for which in ("target", "draft"):
        models = {path: getattr(pair, which) for path, pair in pairs.items() if getattr(pair, which) is not None}
        if not models:
            continue
        ms = lockstep_ms(models, {path: cached(model, CONTEXT) for path, model in models.items()}, CONTEXT, repeat)
        lines.append(f"{pair_name} {which} in {mode}: ms per forward over T tokens after {CONTEXT} cached")
        for t in TOKENS:
            lines.append(f"  T={t:2}  C kernel {ms['c', t]:7.1f}   oneDNN {ms['onednn', t]:7.1f}   "
                         f"C / oneDNN {ms['c', t] / ms['onednn', t]:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.int8_paths", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="qwen-coder", help="model pair (default: qwen-coder)")
    p.add_argument("--weights", default="int8", choices=("int8", "int4"), help="weights mode (default: int8)")
    p.add_argument("--repeat", type=int, default=5, help="forwards per point (default: 5)")
    args = p.parse_args(argv)
    print("\n".join(bench(args.pair, args.weights, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
