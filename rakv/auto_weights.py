"""A pair's ``--weights``: each model's mode chosen (``choose_weights``) and applied
(``with_weights``: its Linear layers quantized, its fingerprint tagged); and ``auto`` for a
quantized checkpoint: the fastest mode on the CPU at hand, by measurement. The modes
themselves, and how one model's layers run in each, are ``rakv.weights``'.

Every mode's rows are exact (``rakv.weights``), so among the modes a GGUF file with
quantized tensors can run as (fp32: the file dequantized; int8; int4: its 4-bit tensors as
stored, where it has them) the choice is one of speed, and speed turns on the CPU: on an
AVX-512 VNNI machine int4 streams the fewest bytes at full rate, while on one whose
kernels run the portable loop fp32's oneDNN layers win. A float checkpoint stays fp32
(quantizing it would be another, lossier model than the one given).

What is timed: the pair's own Linear layers, one of each kind (input and output width,
and how the mode runs it), in each candidate mode's forward, over 1 row and over 5 (a
decode step, which every policy takes, the draft's included, and a verification of 4
drafted tokens, about the k ``rakv`` plans), one call each after a warm-up, the median of
``REPEATS``. A mode's cost is each kind's 1-row plus 5-row time times how many layers of
that kind the pair has. Each timed call finds its layer's weights in memory, not in
cache, as a forward does (it streams every layer once): the calls cycle over copies of the
layer that together hold twice the last-level cache. On a Zen 3 (AVX2, 32 MiB L3), where
int4 runs Qwen's ``ar`` 1.45x and ``rakv`` 1.06x faster than int8, both older ways took
int8 or tossed a coin: timed hot, one int8 MLP layer sat in the L3 and its 1-row time came
out near int4's; with a 9-row forward in place of the 5-row one, verification weighed so
much that int4 and int8 came out 406 against 405 ms. A buffer written between calls to
evict the layer evicted code and page tables too (SmolLM2's small layers took 3x their
time in a forward). The Linear layers are what differ between the modes; the rest of a
forward (attention, norms) costs alike. It is not the calibration's timing of each mode,
which would load and calibrate the pair once per mode (minutes, and the Qwen pair's 8 GB
in fp32 for each): this takes seconds for SmolLM2 and about a minute for the Qwen pair, on
the layers already loaded, once per machine.

Results are cached per machine, kernel path and checkpoint as JSON under
``<cache root>/weights-choice/``; the choice and its figures are printed once.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from rakv.kernels import KernelUnavailable, kernel, kernel_or_none, machine_id, path_here
from rakv.weights import (AUTO, FOUR_BIT, FP32, INT4, INT8, KERNEL_OPS, TORCH_OPS, linear_forward, quantizable,
                          quantize_linears, return_freed_memory, split_modes, tagged)

REPEATS = 5  # timed calls per layer kind and row count
ROWS = (1, 5)  # a decode step, a verification of 4 drafted tokens
LLC_FALLBACK_BYTES = 32 * 2**20  # the last-level cache where the OS does not say
MAX_COPIES = 64  # copies of a layer cycled over at most
WEIGHT_BYTES = {FP32: 4.0, INT8: 1.0, INT4: 0.5}  # per weight, near enough to size the copies
METHOD = 2  # part of the cached results' key (with ROWS): 2, timed from memory (1: hot in cache)


def choose_weights(choice: str, stored: list[dict], models, key: str = "") -> str:
    """The mode ``choice`` (one of WEIGHTS: ``split_modes`` checked it) means for these
    models; raises ValueError (one line) where it cannot run. ``stored``: for each model,
    how its checkpoint stores each Linear (``rakv.gguf_groups.stored_linears``: GGUF type
    names, ``GroupedWeight``s for the 4-bit groups it matched, ``StoredRows``); empty
    for a float one. ``auto`` measures the candidates (``fastest_mode``), cached
    under ``key`` (the checkpoint's fingerprints)."""
    from rakv import int4
    from rakv.gguf_groups import PLAIN
    mode = choice
    if choice == AUTO:
        kinds = [k for held in stored for k in held.values()]
        four_bit = any(isinstance(k, int4.GroupedWeight) for k in kinds)
        quantized = four_bit or any(isinstance(k, str) and k not in PLAIN for k in kinds)
        mode = INT4 if four_bit else INT8 if quantized else FP32
    if mode != FP32 and not all(quantizable(m) for m in models if m is not None):
        raise ValueError(f"--weights {mode} needs float32 or float64 models on a CPU")
    if mode != FP32:
        try:
            kernel()
        except KernelUnavailable as exc:
            if choice != AUTO:
                raise KernelUnavailable(f"--weights {mode}: {exc}") from None
            print(f"warning: {exc}; running fp32 instead", file=sys.stderr)
            return FP32
    if choice == AUTO:
        return fastest_mode(models, stored, candidates(four_bit, quantized), key)
    return mode


def _shares_layers(target, draft) -> bool:
    """Whether ``draft`` runs modules of ``target`` (a layer-prefix draft)."""
    held = {id(m) for m in target.modules()}
    return any(id(m) in held for m in draft.modules())


def with_weights(pair, choice: str, gguf_paths: tuple[Path | None, Path | None] = (None, None)):
    """``pair`` (a ``rakv.models.ModelPair``) in the modes ``choice`` names (``split_modes``;
    each resolved by ``choose_weights``): its Linear layers quantized in place, its
    fingerprints tagged with each model's mode and plan. ``gguf_paths``: the GGUF file each
    of target and draft was loaded from, or None (a float checkpoint, or a draft that
    shares the target's layers)."""
    target_choice, draft_choice = split_modes(choice)
    models = (pair.target, pair.draft)
    stored = [{}, {}]
    if {target_choice, draft_choice} & {AUTO, *FOUR_BIT}:
        from rakv.gguf_groups import stored_linears
        stored = [stored_linears(path, model) if path is not None and model is not None else {}
                  for path, model in zip(gguf_paths, models)]
    keys = (f"{pair.target_fingerprint}|{pair.draft_fingerprint}", str(pair.target_fingerprint),
            str(pair.draft_fingerprint))
    if draft_choice is None:  # one mode: auto looks at both files at once
        modes = (choose_weights(target_choice, stored, models, keys[0]),) * 2
    else:
        modes = (choose_weights(target_choice, stored[:1], models[:1], keys[1]),
                 choose_weights(draft_choice, stored[1:], models[1:], keys[2]))
        if pair.draft is not None and modes[0] != modes[1] and _shares_layers(pair.target, pair.draft):
            raise ValueError(f"--weights {choice}: this draft runs the target's own layers, so it runs in the "
                             f"target's mode; give one mode")
    plans, ops = [(), ()], [KERNEL_OPS, KERNEL_OPS]
    from rakv.joined_linears import join_layers
    from rakv.layer_kernel import use_kernel_norms
    from rakv.row_attention import use_row_exact_attention
    for i, (model, mode) in enumerate(zip(models, modes)):
        if model is not None and mode != FP32:
            plans[i] = quantize_linears(model, mode, stored[i])
            join_layers(model)  # the same bits in fewer calls: not another model
            use_row_exact_attention(model)
            ops[i] = KERNEL_OPS if use_kernel_norms(model) else TORCH_OPS
    if any(mode != FP32 for mode in modes):
        return_freed_memory()
    weights = modes[0] if pair.draft is None or modes[0] == modes[1] else f"{modes[0]}/{modes[1]}"
    return dataclasses.replace(pair, weights=weights,
                               target_fingerprint=tagged(pair.target_fingerprint, modes[0], plans[0], ops[0]),
                               draft_fingerprint=tagged(pair.draft_fingerprint, modes[1], plans[1], ops[1]))


def candidates(four_bit: bool, quantized: bool) -> tuple[str, ...]:
    """The modes auto chooses among: int4 only where the file holds 4-bit tensors (else it
    would quantize floats to 4 bits), int8 and fp32 for any quantized file."""
    if not quantized:
        return (FP32,)
    return (INT4, INT8, FP32) if four_bit else (INT8, FP32)


def fastest_mode(models, stored: list[dict], modes: tuple[str, ...], key: str) -> str:
    """The mode of ``modes`` whose Linear layers of ``models`` (each with its
    ``rakv.gguf_groups.stored_linears``) cost least here, measured once per ``key`` (the
    checkpoint's fingerprints) and cached."""
    if len(modes) == 1:
        return modes[0]
    costs = _cached_costs(models, stored, modes, key)
    best = min(modes, key=costs.get)
    figures = ", ".join(f"{mode} {1e3 * costs[mode]:.1f} ms" for mode in sorted(modes, key=costs.get))
    print(f"weights auto: {best} (Linear layers of a step and a {ROWS[-1]}-token forward on this CPU: {figures})",
          file=sys.stderr)
    return best


def _cached_costs(models, stored, modes, key) -> dict[str, float]:
    from rakv.model_files import cache_root
    library = kernel_or_none()
    path = path_here() if library is not None else "none"
    method = f"{METHOD}|{ROWS}"
    name = hashlib.blake2b(f"{key}|{','.join(modes)}|{path}|{getattr(library, '_name', '')}|{method}".encode(),
                           digest_size=8).hexdigest()
    cached = cache_root() / "weights-choice" / f"{machine_id()}-{name}.json"
    try:
        costs = json.loads(cached.read_text())
        if set(costs) == set(modes):
            return costs
    except (OSError, ValueError):
        pass  # not measured yet, or a damaged file: measured again
    print(f"weights auto: timing the Linear layers in {', '.join(modes)} on this CPU (once; about a minute "
          f"for a 1.5B pair)", file=sys.stderr, flush=True)
    costs = {mode: mode_cost(models, stored, mode) for mode in modes}
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".tmp")
    partial.write_text(json.dumps(costs))
    partial.replace(cached)
    return costs


def mode_cost(models, stored: list[dict], mode: str) -> float:
    """Seconds of one forward over each of ``ROWS`` of every Linear layer of ``models`` in
    ``mode``, one layer of each kind timed (``layer_kinds``), from memory (``_num_copies``)."""
    total = 0.0
    for (in_features, out_features, _), (make, count) in layer_kinds(models, stored, mode).items():
        copies = [make() for _ in range(_num_copies(in_features * out_features * WEIGHT_BYTES[mode]))]
        total += count * sum(_median_s(copies, rows, in_features) for rows in ROWS)
    return total


def _num_copies(layer_bytes: float) -> int:
    """Copies of a layer that hold twice the last-level cache (at least 2, at most MAX_COPIES)."""
    return max(2, min(MAX_COPIES, int(2 * _last_level_cache_bytes() / max(layer_bytes, 1.0)) + 1))


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest cache the OS reports for CPU 0 (Linux sysfs), else LLC_FALLBACK_BYTES."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=LLC_FALLBACK_BYTES)


def layer_kinds(models, stored: list[dict], mode: str) -> dict[tuple[int, int, str], tuple[Callable, int]]:
    """(input width, output width, how ``mode`` runs it) -> (a maker of that forward for
    one such layer, how many layers of ``models`` are of that kind)."""
    import torch
    kinds: dict = {}
    for model, held in zip(models, stored):
        if model is None:
            continue
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not None:
                how, make = _how(mode, module, held.get(name))
                kind = (module.in_features, module.out_features, how)
                first, count = kinds.get(kind, (make, 0))
                kinds[kind] = (first, count + 1)
    return kinds


def _how(mode: str, module, source) -> tuple[str, Callable]:
    """How ``mode`` runs a Linear (fp32: oneDNN's packed layer; the others:
    ``rakv.weights.linear_forward``, the rules the loaded model follows), and a maker of
    that forward."""
    from rakv.cpu_linear import PackedForward
    if mode == FP32:
        return FP32, lambda: PackedForward(module)
    return linear_forward(mode, module, source)


def _median_s(copies: list, rows: int, in_features: int) -> float:
    """The median time of a call over ``rows`` rows, the calls cycling over ``copies`` (each
    finds its weights gone from cache, as in a forward), REPEATS passes after a warm-up one."""
    import torch
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        for forward in copies:
            forward(x)  # warm-up: the kernel's first call, its scratch buffers, the pages
        times = []
        for _ in range(REPEATS):
            for forward in copies:
                start = time.perf_counter()
                forward(x)
                times.append(time.perf_counter() - start)
    return statistics.median(times)
