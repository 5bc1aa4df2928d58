"""The kernels' paths against each other on one loaded pair: every path this CPU runs
(``rakv.kernels.PATHS``: portable, AVX2, 256-bit VNNI, AVX-512 VNNI, AMX), each forced in
turn on the same model. They give the same bits (tests/test_int4.py, test_weights.py),
so this measures speed alone: what a CPU without the faster paths would get from this
one's memory and core (an AVX-512 machine runs the AVX2 path as an AVX2 CPU would, at its
own clock and bandwidth).

    python -m bench.kernel_paths                               # qwen-coder target, int8 and int4
    python -m bench.kernel_paths --weights int8/int4-pure --model draft --repeat 7
    python -m bench.kernel_paths --paths avx2,avx512

One torch thread. For each T the paths alternate (lockstep), each figure the median of
``--repeat`` forwards over the same ``--context`` cached tokens, rolled back after each.
Prints, per mode and path, the one-token step in ms and a forward over T tokens in steps
of that path (what verification costs), and the step over the fastest path's.
"""
from __future__ import annotations

import argparse
import platform
import sys

from bench.step import TOKENS, cached, lockstep_ms


def bench(pair_name: str, mode: str, which: str, paths: list[int], context: int, repeat: int) -> list[str]:
    import torch
    torch.set_num_threads(1)
    from rakv import kernels
    from rakv.models import load_pair
    pair = load_pair(pair_name, weights_mode=mode)
    model = getattr(pair, which)
    names = {kernels.PATHS[p]: p for p in paths}
    ms = lockstep_ms({name: model for name in names}, {name: cached(model, context) for name in names}, context,
                     repeat, before=lambda name: kernels.use_path(names[name]))
    kernels.use_path(kernels.FASTEST)
    fastest = max(names, key=names.get)
    lines = [f"{pair_name} {which} in {pair.weights} ({platform.processor() or platform.machine()}, "
             f"CPU path {kernels.PATHS[kernels.cpu_path()]}): a step in ms, a forward over T tokens in steps, "
             f"after {context} cached",
             f"  {'path':9} {'step ms':>8} " + " ".join(f"{'T=' + str(t):>6}" for t in TOKENS[1:])
             + f"  step / {fastest}'s"]
    for name in names:
        step = ms[name, 1]
        lines.append(f"  {name:9} {step:8.1f} " + " ".join(f"{ms[name, t] / step:6.2f}" for t in TOKENS[1:])
                     + f"  {step / ms[fastest, 1]:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from rakv import kernels
    from rakv.cli import run_cli
    from rakv.models import PairError
    p = argparse.ArgumentParser(prog="python -m bench.kernel_paths", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="qwen-coder", help="model pair (default: qwen-coder)")
    p.add_argument("--weights", default="int8,int4", help="comma-separated weights modes (default: int8,int4)")
    p.add_argument("--model", default="target", choices=("target", "draft"), help="which model (default: target)")
    p.add_argument("--paths", default="", help="comma-separated paths (default: every path this CPU runs but "
                                               "portable, which is 10-40x slower)")
    p.add_argument("--context", type=int, default=300, help="cached tokens before each forward (default: 300)")
    p.add_argument("--repeat", type=int, default=5, help="forwards per point (default: 5)")
    return run_cli(run, p.parse_args(argv), (ValueError, PairError, kernels.KernelUnavailable))


def run(args) -> int:
    from rakv import kernels
    here = kernels.paths_here()
    if args.paths:
        wanted = [name.strip() for name in args.paths.split(",")]
        unknown = [n for n in wanted if n not in kernels.PATHS or kernels.PATHS.index(n) not in here]
        if unknown:
            raise ValueError(f"--paths: {', '.join(unknown)} not among this CPU's paths "
                             f"({', '.join(kernels.PATHS[p] for p in here)})")
        paths = sorted(kernels.PATHS.index(n) for n in wanted)
    else:
        paths = [p for p in here if p != 0]
    for mode in args.weights.split(","):
        print("\n".join(bench(args.pair, mode.strip(), args.model, paths, args.context, args.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
