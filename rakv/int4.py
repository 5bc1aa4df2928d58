"""int4 groupwise Linear layers on a small C kernel (``int4_kernel.c``, in the library
``rakv.kernels`` builds).

A weight is 4-bit integers in groups of ``GROUP`` inputs, each group with a scale and an
offset: w[n, k] = a[n, g] * q[n, k] + b[n, g], q in 0..15, a and b 8-bit steps of float
units shared by a few groups. GGUF's Q4_0, Q4_1 and Q4_K tensors are all of this form, so
``rakv.gguf_groups`` hands them over as they are stored; float weights are quantized here
(each group between its min and max, the steps and units as Q4_K keeps them).
The input is quantized per row and group to int8 (llama.cpp's Q8_0), and the kernel
multiplies 4-bit by 8-bit into int32 sums: AVX-512 VNNI, 256-bit VNNI or AVX2, whichever
is fastest on the CPU at hand (``rakv.kernels``), the same bits on each.

Why a kernel of our own: torch 2.13's int4 op (``_weight_int4pack_mm_for_cpu``) re-reads
the weights for every row, so verifying 8 tokens cost 3.4 steps, and torchao 0.18's CPU
wheel ships no x86 kernels for it. This one reads each weight block once for up to 12 rows.

Invariants:
- **Rows never mix, bit for bit**, on each of the kernel's paths and whichever rows and
  threads run together (the kernel's comment says why); tests/test_int4.py checks it.
- Where the library cannot be built (``rakv.kernels.KernelUnavailable``), int4 is not
  offered.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rakv.kernels import FASTEST, LANES, kernel, kernel_forward  # import no torch either

if TYPE_CHECKING:
    import torch

GROUP = 32  # inputs per group; the kernel's GROUP
LEVELS = 15  # q in 0..LEVELS
STEPS = 255  # a scale or offset step in 0..STEPS
PER_UNIT = 8  # groups per unit when quantizing float weights (Q4_K's super-block of 256)

@dataclasses.dataclass(frozen=True)
class GroupedWeight:
    """w = a q + b, group by group, with a = a_unit * a_step and b = b_unit * b_step, each
    unit shared by ``per_unit`` consecutive groups (GGUF Q4_K: 8; Q4_0, Q4_1: 1).

    q [out, in] uint8 in 0..15; a_step, b_step [out, in / GROUP] uint8; a_unit, b_unit
    [out, in / GROUP / per_unit] float32 holding float16 values (GGUF's units are f16;
    the kernel keeps them so)."""
    q: torch.Tensor
    a_step: torch.Tensor
    b_step: torch.Tensor
    a_unit: torch.Tensor
    b_unit: torch.Tensor
    source: str  # what it came from: a GGUF type ("Q4_K"), or "float" (quantized here)

    TENSORS = ("q", "a_step", "b_step", "a_unit", "b_unit")  # the fields above that are tensors, in order

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.TENSORS)

    @property
    def per_unit(self) -> int:
        return self.a_step.shape[1] // self.a_unit.shape[1]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [out, groups] float32, rounded as the kernel rounds them."""
        return _times(self.a_unit, self.a_step), _times(self.b_unit, self.b_step)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight this model runs."""
        import torch
        out, inputs = self.q.shape
        a, b = self.scales()
        q = self.q.to(torch.float32).view(out, inputs // GROUP, GROUP)
        return (a[..., None] * q + b[..., None]).view(out, inputs)


def quantize_groups(weight: torch.Tensor) -> GroupedWeight:
    """A float weight [out, in] to 4-bit groups as Q4_K does it: each group between its min
    (at most 0) and max, the scale and offset 8-bit steps of a unit per 8 groups (1 where
    the groups do not come in eights)."""
    import torch
    out, inputs = weight.shape
    groups = inputs // GROUP
    per_unit = PER_UNIT if groups % PER_UNIT == 0 else 1
    w = weight.detach().to(torch.float32).view(out, groups, GROUP)
    # offsets b = -unit * step <= 0, rounded down so that b stays at or below each group's min
    b_unit, b_step = _steps(-w.amin(dim=2).clamp_max(0.0), per_unit)
    b_unit = -b_unit
    b = _times(b_unit, b_step)  # [out, groups]
    a_unit, a_step = _steps((w.amax(dim=2) - b).clamp_min(0.0) / LEVELS, per_unit)  # up: covers each max
    grouped = GroupedWeight(torch.zeros(out, inputs, dtype=torch.uint8), a_step, b_step, a_unit, b_unit, "float")
    a, b = grouped.scales()
    inverse = torch.where(a > 0, 1 / a, torch.zeros_like(a))
    q = torch.round((w - b[..., None]) * inverse[..., None]).clamp(0, LEVELS).to(torch.uint8)
    return dataclasses.replace(grouped, q=q.view(out, inputs))


def _times(unit: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """unit [out, units] times step [out, groups] -> [out, groups] float32, each unit
    serving groups / units consecutive groups."""
    import torch
    return unit.repeat_interleave(step.shape[1] // unit.shape[1], dim=1) * step.to(torch.float32)


def _steps(values: torch.Tensor, per_unit: int):
    """values [out, groups] >= 0 as unit [out, groups / per_unit] times 8-bit steps, each
    rounded up (unit * step >= value, to float rounding)."""
    import torch
    out, groups = values.shape
    unit = _f16_up(values.view(out, groups // per_unit, per_unit).amax(dim=2) / STEPS)  # [out, units]
    if per_unit == 1:
        return _f16_up(values), torch.ones(out, groups, dtype=torch.uint8)
    inverse = torch.where(unit > 0, 1 / unit, torch.zeros_like(unit)).repeat_interleave(per_unit, dim=1)
    return unit, torch.ceil(values * inverse).clamp(0, STEPS).to(torch.uint8)


def _f16_up(values: torch.Tensor) -> torch.Tensor:
    """values >= 0 rounded up to float16 values, as float32."""
    import torch
    halves = values.clamp_max(torch.finfo(torch.float16).max).to(torch.float16)
    up = torch.nextafter(halves, torch.full_like(halves, float("inf")))
    return torch.where(halves.to(torch.float32) < values, up, halves).to(torch.float32)


def packable(weight_shape) -> bool:
    """Whether a Linear of this weight shape [out, in] can run in int4 groups."""
    return weight_shape[1] % GROUP == 0


def pack(grouped: GroupedWeight):
    """The kernel's layout (see int4_kernel.c): packed bytes [blocks, groups, 4, 64]; a_step,
    b_step [blocks, groups, 16] uint8, or None where every step is 1 and each group has its
    own unit (Q4_0, Q4_1: the file's 20 bytes per 32 weights); a_unit, b_unit [blocks,
    units, 16] float16; output channels padded with zeros to whole blocks."""
    import torch
    for unit in (grouped.a_unit, grouped.b_unit):
        if not torch.equal(unit.to(torch.float16).to(torch.float32), unit):
            raise ValueError("int4 units must be float16 values")
    out, inputs = grouped.q.shape
    blocks, groups = -(-out // LANES), inputs // GROUP
    pad = blocks * LANES - out
    padded = [torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t for t in grouped.tensors()]
    q = padded[0]
    # [block, lane, group, half, load, input of 4]: half 0 is inputs 0..15 of a group, 1 is 16..31
    q = q.view(blocks, LANES, groups, 2, 4, 4)
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [block, lane, group, load, 4]
    packed = nibbles.permute(0, 2, 3, 1, 4).contiguous()  # [block, group, load, lane, 4]
    lanes = lambda t: t.view(blocks, LANES, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
    a_step, b_step, a_unit, b_unit = padded[1:]
    no_steps = grouped.per_unit == 1 and bool((grouped.a_step == 1).all() and (grouped.b_step == 1).all())
    steps = (None, None) if no_steps else (lanes(a_step), lanes(b_step))
    return (packed, *steps, lanes(a_unit.to(torch.float16)), lanes(b_unit.to(torch.float16)))


class Int4Forward:
    """A Linear's forward on int4 groups: x [..., in] -> [..., out] in x's dtype."""

    def __init__(self, linear: torch.nn.Linear, grouped: GroupedWeight):
        import torch
        self.lib = kernel()
        self.packed, self.a_step, self.b_step, self.a_unit, self.b_unit = pack(grouped)
        self.per_unit = grouped.per_unit
        if self.per_unit & (self.per_unit - 1):  # the kernel shifts where it would divide
            raise ValueError(f"int4 groups share a unit in powers of two, not {self.per_unit}")
        self.out_features, self.in_features = grouped.q.shape
        self.padded = self.packed.shape[0] * LANES  # the kernel writes whole blocks of 16
        self.bias = None  # [padded]
        if linear.bias is not None:
            self.bias = torch.zeros(self.padded)
            self.bias[:self.out_features] = linear.bias.detach().to(torch.float32)
        self.source = grouped.source
        self.path = FASTEST  # or one of rakv.kernels.PATHS' indices (tests compare them)
        self.layer_arguments = self.arguments()

    TENSORS = ("packed", "a_step", "b_step", "a_unit", "b_unit", "bias")  # each [blocks or padded, ...]

    def arguments(self) -> tuple:
        """The kernel's arguments that never change, from packed to n (the tensors stay held)."""
        return (*(None if t is None else t.data_ptr()
                  for t in (self.packed, self.a_step, self.b_step, self.a_unit, self.b_unit)),
                self.per_unit, None if self.bias is None else self.bias.data_ptr(), self.padded)

    @property
    def num_bytes(self) -> int:
        """The bytes this layer holds."""
        held = (self.packed, self.a_step, self.b_step, self.a_unit, self.b_unit, self.bias)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_forward(self, self.lib.rakv_int4_linear, x, "int4")
