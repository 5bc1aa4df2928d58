"""Quantized Linear layers that read the same input, run as one kernel call: a decoder
layer's q, k and v projections, and its gate and up projections.

Why: each kernel call costs 11-13 us of Python and ctypes besides its arithmetic, and a
Qwen2.5-Coder 0.5B draft step made 169 of them (cProfile), 3 and 2 of each layer's 7 on
one input. Joined, a layer makes 4.

Invariants:
- **The same bits.** The int8 and int4 kernels compute each output channel alone from the
  row's quantized input, and the row is quantized the same way for every layer that reads
  it; a joined call runs the same kernel on the same input, so each part's outputs are
  the bits its own call gives (tests/test_joined_linears.py).
- **No second copy.** The joined layer's tensors are the parts' concatenated, and each
  part's tensors become views into them: the memory held is the parts' (plus nothing).
- Each part keeps its own forward (a view of the joined weights), so Hugging Face's
  forward, which calls the parts, runs as before (the reference for outputs).
  ``rakv.direct_forward`` runs the joined call only while every part's module still runs
  that forward (``Joined.current``): a kernel swapped in later is the one that runs.
- Importing this module loads no torch.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Joined:
    """One kernel call for ``parts`` (quantized forwards of one class): its outputs [...,
    sum of the parts' padded widths] hold part i's at ``starts[i]``."""

    forward: object  # an Int8Forward or Int4Forward over the concatenated tensors
    parts: tuple  # the parts' forwards, in order
    starts: tuple[int, ...]
    widths: tuple[int, ...]  # each part's out_features

    def __call__(self, x):
        """x [..., in] -> each part's output [..., out_i], views of one joined output."""
        out = self.forward(x)
        return tuple(out[..., start:start + width] for start, width in zip(self.starts, self.widths))

    def current(self, modules) -> bool:
        """Whether every module of ``modules`` (the parts' own) still runs its part."""
        return all(vars(module).get("forward") is part for module, part in zip(modules, self.parts))


def join(parts) -> Joined | None:
    """The joined forward of ``parts`` (quantized forwards), or None where they cannot run
    as one call: another class or input width, int4 groups of another shape, a bias on
    some only. The parts' tensors become views of the joined ones."""
    import torch
    first = parts[0]
    kind = type(first)
    if len(parts) < 2 or any(type(p) is not kind or p.in_features != first.in_features for p in parts) \
            or not hasattr(kind, "TENSORS") \
            or any(getattr(p, "per_unit", None) != getattr(first, "per_unit", None) for p in parts):
        return None
    for name in kind.TENSORS:
        held = [getattr(p, name) for p in parts]
        if any(t is None for t in held) and not all(t is None for t in held):
            return None
        if held[0] is not None and any(t.shape[1:] != held[0].shape[1:] for t in held):
            return None
    joined = copy.copy(first)
    for name in kind.TENSORS:
        held = [getattr(p, name) for p in parts]
        if held[0] is None:
            continue
        whole = torch.cat(held)
        setattr(joined, name, whole)
        start = 0
        for part, tensor in zip(parts, held):
            setattr(part, name, whole[start:start + tensor.shape[0]])  # a view: the memory is the joined one's
            start += tensor.shape[0]
    joined.padded = joined.out_features = sum(p.padded for p in parts)  # the caller slices each part's
    for layer in (*parts, joined):
        layer.layer_arguments = layer.arguments()
    starts = tuple(sum(p.padded for p in parts[:i]) for i in range(len(parts)))
    return Joined(joined, tuple(parts), starts, tuple(p.out_features for p in parts))


def join_layers(model) -> int:
    """Join each decoder layer's q/k/v and gate/up of ``model`` where they are quantized
    (``GROUPS``); kept on the attention and MLP modules as ``_rakv_joined``. Returns how
    many groups were joined. Modules shared with another model are joined once."""
    count = 0
    for module in model.modules():
        for kind, names in GROUPS.items():
            owner = getattr(module, kind, None)
            if owner is None or "_rakv_joined" in vars(owner) or not all(hasattr(owner, n) for n in names):
                continue
            forwards = [vars(getattr(owner, n)).get("_rakv_quantized") for n in names]
            joined = None if None in forwards else join(forwards)
            owner._rakv_joined = joined
            count += joined is not None
    return count
