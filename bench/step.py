"""A decode step per weights mode (``rakv.weights``): what a forward over T tokens costs,
where a one-token step's time goes, and the memory each mode holds.

    python -m bench.step                              # qwen-coder target, fp32, int8 and int4
    python -m bench.step --pair smollm2 --model target
    python -m bench.step --pair qwen-coder --model draft --context 300 --repeat 7

One torch thread. Each mode's pair is loaded once; for each T the modes alternate
(lockstep) and each figure is the median of ``--repeat`` forwards over the same cached
context, rolled back after each. Prints, per mode:
- ms per forward over T tokens, as a multiple of that mode's one-token step (what
  verification costs) and of float32's (what the mode gains);
- a one-token step and a 9-token forward split by torch.profiler: Linear kernels,
  attention, other torch ops, and the rest (Python and dispatch: wall time no op
  accounts for);
- memory, the pair's both models loaded, each mode in a fresh process (``--rss``): the
  model's weights as held (each quantized layer's bytes, a tied weight once), the peak
  RSS, and after loading its anonymous part (the tensors the process holds; the rest are
  file pages the loader mapped, which the kernel may drop).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TOKENS = (1, 2, 3, 5, 9, 17)
SPLIT_TOKENS = (1, 9)  # a step, and a verification of 8 drafted tokens
LINEAR_OPS = ("rakv_int4_linear", "rakv_int8_linear", "qlinear_pointwise", "_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "rakv_attention")
C_OTHER = ("rakv_rms_norm", "rakv_rope")
C_CALLS = ("rakv_int4_linear", "rakv_int8_linear", "rakv_attention", *C_OTHER)  # the C library's, by name


def forward_ms(model, cache, num_context: int, num_tokens: int) -> float:
    from rakv.decoding import crop_to, forward
    ids = [(100 + i) % model.config.vocab_size for i in range(num_tokens)]
    start = time.perf_counter()
    forward(model, cache, ids, num_logits=num_tokens)
    seconds = time.perf_counter() - start
    crop_to(cache, num_context)
    return 1e3 * seconds


def cached(model, num_context: int):
    from rakv.decoding import forward
    from rakv.kv_cache import GrowingCache
    cache = GrowingCache()
    forward(model, cache, [(100 + i % 1000) % model.config.vocab_size for i in range(num_context)])
    return cache


def lockstep_ms(models: dict, caches: dict, num_context: int, repeat: int,
                before=lambda name: None) -> dict[tuple, float]:
    """(name, T) -> median ms of a forward over T tokens after ``num_context`` cached, the
    models alternating for each T (lockstep: the machine's drift falls on all alike);
    ``before(name)`` runs before each of name's forwards."""
    times = {(name, t): [] for name in models for t in TOKENS}
    for _ in range(repeat):
        for t in TOKENS:
            for name, model in models.items():
                before(name)
                times[name, t].append(forward_ms(model, caches[name], num_context, t))
    return {key: statistics.median(v) for key, v in times.items()}


def step_split_ms(model, cache, num_context: int, repeat: int, num_tokens: int = 1) -> dict[str, float]:
    """A forward over ``num_tokens`` split by the profiler's self times (ms, medians)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from rakv.kernels import kernel_or_none
    splits = []
    lib = kernel_or_none()
    # the C library's calls are ones the profiler cannot see: each runs under its own name
    originals = {name: getattr(lib, name) for name in C_CALLS} if lib is not None else {}

    def labelled(function, name):
        def run(*args):
            with record_function(name):
                return function(*args)
        return run
    for _ in range(repeat):
        for name, function in originals.items():
            setattr(lib, name, labelled(function, name))
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall_ms = forward_ms(model, cache, num_context, num_tokens)
        finally:
            for name, function in originals.items():
                setattr(lib, name, function)
        split = {"linear": 0.0, "attention": 0.0, "other ops": 0.0}
        for event in prof.key_averages():
            ms = event.self_cpu_time_total / 1e3
            if any(op in event.key for op in LINEAR_OPS):
                split["linear"] += ms
            elif any(op in event.key for op in ATTENTION_OPS):
                split["attention"] += ms
            elif event.key.startswith(("aten::", "onednn::", "mkldnn::")) or event.key in C_OTHER:
                split["other ops"] += ms
        split["python and dispatch"] = max(0.0, wall_ms - sum(split.values()))
        split["wall"] = wall_ms
        splits.append(split)
    return {key: statistics.median(s[key] for s in splits) for key in splits[0]}


def rss_report(pair_name: str, mode: str, which: str) -> dict:
    """Load the pair in ``mode`` in this process, run one step; its memory (MiB). The peak
    is the kernel's VmHWM, this process image's own: ``ru_maxrss`` keeps the high-water
    mark across exec, so a child of a process holding 20 GB reported 20 GB."""
    import torch
    torch.set_num_threads(1)
    from rakv.models import load_pair
    pair = load_pair(pair_name, weights_mode=mode)
    model = pair.target if which == "target" else pair.draft
    cached(model, 8)
    with open("/proc/self/status") as status:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in status
               if line.startswith(("VmHWM", "VmRSS", "RssAnon"))}
    return {"mode": mode, "peak_rss_mib": kib["VmHWM"] / 1024,
            "rss_mib": kib["VmRSS"] / 1024, "anonymous_rss_mib": kib["RssAnon"] / 1024,
            "weights_mib": weight_bytes(model) / 2**20}


def weight_bytes(model) -> int:
    """The bytes of weights ``model`` holds: each quantized layer's own (``num_bytes``), and
    every other parameter and buffer once (a tied weight counts once)."""
    seen, total = set(), 0
    for module in model.modules():
        quantized = vars(module).get("_rakv_quantized")
        if quantized is not None:
            total += quantized.num_bytes
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                total += tensor.untyped_storage().nbytes()
    return total


def bench(pair_name: str, modes: list[str], which: str, num_context: int, repeat: int) -> list[str]:
    import torch
    torch.set_num_threads(1)
    from rakv.models import load_pair
    models = {}
    for mode in modes:
        pair = load_pair(pair_name, weights_mode=mode)
        models[mode] = pair.target if which == "target" else pair.draft
        if models[mode] is None:
            raise ValueError(f"{pair_name} has no {which} model")
        if num_context + max(TOKENS) > pair.max_positions:
            raise ValueError(f"--context {num_context} leaves no room for {max(TOKENS)} tokens in {pair_name}'s "
                             f"{pair.max_positions} positions")
    caches = {mode: cached(model, num_context) for mode, model in models.items()}
    ms = lockstep_ms(models, caches, num_context, repeat)
    base = ms[modes[0], 1]
    lines = [f"{pair_name} {which}: ms per forward over T tokens after {num_context} cached "
             f"(x the mode's own 1-token step; x {modes[0]}'s step)"]
    for t in TOKENS:
        lines.append(f"  T={t:2}  " + "   ".join(f"{mode} {ms[mode, t]:7.1f} ({ms[mode, t] / ms[mode, 1]:4.2f}x; "
                                                  f"{ms[mode, t] / base:4.2f}x)" for mode in modes))
    for t in SPLIT_TOKENS:
        lines.append(f"a forward over {t} token{'s' * (t > 1)}, split (ms, torch.profiler self times; medians)")
        for mode in modes:
            split = step_split_ms(models[mode], caches[mode], num_context, repeat, t)
            lines.append(f"  {mode}: " + ", ".join(f"{key} {value:.1f}" for key, value in split.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    from rakv.weights import FP32, INT4, INT8, WEIGHTS, split_modes
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pair", default="qwen-coder")
    p.add_argument("--model", choices=("target", "draft"), default="target")
    p.add_argument("--weights", default=f"{FP32},{INT8},{INT4}", help="modes, comma-separated, the first the "
                   f"baseline, each MODE or TARGET/DRAFT (from {', '.join(WEIGHTS)}; default: fp32,int8,int4)")
    p.add_argument("--context", type=int, default=300, help="cached tokens before each forward (default: 300)")
    p.add_argument("--repeat", type=int, default=5, help="forwards per (mode, T) (default: 5)")
    p.add_argument("--rss", default=None, help=argparse.SUPPRESS)  # internal: one mode's memory, as JSON
    args = p.parse_args(argv)
    modes = args.weights.split(",")
    try:
        if args.rss:
            print(json.dumps(rss_report(args.pair, args.rss, args.model)))
            return 0
        for mode in modes:
            split_modes(mode)  # a one-line error before any model loads
        print("\n".join(bench(args.pair, modes, args.model, args.context, args.repeat)), flush=True)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("resident memory, each mode alone in a fresh process (MiB)")
    for mode in modes:
        done = subprocess.run([sys.executable, "-m", "bench.step", "--pair", args.pair, "--model", args.model,
                               "--rss", mode], capture_output=True, text=True)
        if done.returncode:
            print(f"  {mode}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        rss = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {mode}: weights {rss['weights_mib']:.0f}; peak {rss['peak_rss_mib']:.0f}; after loading "
              f"{rss['rss_mib']:.0f}, of which {rss['anonymous_rss_mib']:.0f} the process's own (the rest: file "
              "pages mapped while loading)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
