"""What a forward over T tokens costs on PyTorch's stock CPU kernels and on oneDNN-packed
Linear layers (``rakv.cpu_linear``), for the pair's target and draft.

    python -m bench.cpu_linear                     # qwen-coder, 300 cached tokens
    python -m bench.cpu_linear --pair smollm2

One torch thread; for each T the two kernels alternate (lockstep) and each figure is the
median of ``--repeat`` forwards over the same cached context, rolled back after each.
Prints milliseconds per forward, each as a multiple of the stock one-token step, and
checks that the packed layers give bit-identical rows whatever the number of rows (the
property that makes a verified token's logits equal its one-token step's).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench.step import TOKENS


def bench_model(model, label: str, num_context: int, repeat: int) -> list[str]:
    from bench.step import cached, forward_ms
    from rakv.cpu_linear import stock_linears
    cache = cached(model, num_context)
    times = {(kernels, t): [] for kernels in ("stock", "onednn") for t in TOKENS}
    for _ in range(repeat):
        for t in TOKENS:
            with stock_linears(model):
                times["stock", t].append(forward_ms(model, cache, num_context, t))
            times["onednn", t].append(forward_ms(model, cache, num_context, t))
    step_ms = statistics.median(times["stock", 1])
    lines = [f"{label}: ms per forward over T tokens after {num_context} cached (x stock 1-token step)"]
    for t in TOKENS:
        stock, packed = statistics.median(times["stock", t]), statistics.median(times["onednn", t])
        lines.append(f"  T={t:2}  stock {stock:7.1f} ({stock / step_ms:4.2f}x)   onednn {packed:7.1f} "
                     f"({packed / step_ms:4.2f}x)   stock/onednn {stock / packed:4.2f}")
    return lines


def rows_are_independent(model) -> bool:
    """Every packed Linear gives a row the same bits alone and among 1..17 other rows."""
    import torch
    torch.manual_seed(0)
    for module in model.modules():
        packed = vars(module).get("_rakv_packed")
        if packed is None:
            continue
        x = torch.randn(1, module.in_features)
        alone = packed(x)
        for rows in (2, 5, 9, 18):
            mixed = packed(torch.cat([torch.randn(rows // 2, module.in_features), x,
                                      torch.randn(rows - 1 - rows // 2, module.in_features)]))
            if not torch.equal(mixed[rows // 2: rows // 2 + 1], alone):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen-coder")
    p.add_argument("--context", type=int, default=300, help="cached tokens before each forward (default: 300)")
    p.add_argument("--repeat", type=int, default=5, help="forwards per (kernels, T) (default: 5)")
    args = p.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(1)
        from rakv.models import load_pair
        pair = load_pair(args.pair, linear_kernels="onednn")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ok = True
    for label, model in (("target", pair.target), ("draft", pair.draft)):
        if model is None:
            continue
        print("\n".join(bench_model(model, f"{args.pair} {label}", args.context, args.repeat)), flush=True)
        independent = rows_are_independent(model)
        print(f"  packed rows bit-identical whatever the row count: {independent}")
        ok &= independent
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
