"""Joined Linear layers (rakv.joined_linears): one kernel call gives each part the bits
of its own call, holds no second copy of the weights, and steps aside for a part whose
forward was swapped."""
from __future__ import annotations

import pytest
import torch

from conftest import NEEDS_KERNELS
from rakv import direct_forward
from rakv.int4 import Int4Forward, quantize_groups
from rakv.joined_linears import join
from rakv.weights import Int8Forward

pytestmark = NEEDS_KERNELS  # the kernels' library: built where a C compiler is

QUANTIZED = {"int8": Int8Forward, "int4": lambda linear: Int4Forward(linear, quantize_groups(linear.weight))}
# (in, outs, bias): Qwen2.5-Coder 0.5B's q/k/v and gate/up, and widths that are no multiple of 16
GROUPS = [(896, (896, 128, 128), True), (896, (4864, 4864), False), (64, (40, 24, 24), True)]


def parts_of(mode: str, in_features: int, outs: tuple[int, ...], bias: bool):
    torch.manual_seed(in_features + sum(outs))
    return [QUANTIZED[mode](torch.nn.Linear(in_features, out, bias=bias)) for out in outs]


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group", GROUPS)
def test_a_joined_call_gives_each_part_its_own_bits(mode, group):
    in_features, outs, bias = group
    parts = parts_of(mode, in_features, outs, bias)
    x = torch.randn(1, 9, in_features)
    before = [[part(x[:, :rows]) for part in parts] for rows in (1, 2, 9)]
    held = sum(part.num_bytes for part in parts)
    joined = join(parts)
    assert joined is not None
    for rows, want in zip((1, 2, 9), before):
        got = joined(x[:, :rows])
        assert all(torch.equal(g, w) for g, w in zip(got, want)), rows
        assert all(torch.equal(part(x[:, :rows]), w) for part, w in zip(parts, want)), rows
    assert sum(part.num_bytes for part in parts) == held
    storage = joined.forward.packed.untyped_storage().data_ptr()
    assert all(part.packed.untyped_storage().data_ptr() == storage for part in parts)  # views, no copy


def test_what_cannot_run_as_one_call_is_not_joined():
    int8 = parts_of("int8", 64, (32, 32), True)
    assert join([int8[0], parts_of("int4", 64, (32,), True)[0]]) is None  # two kernels
    assert join([int8[0], parts_of("int8", 64, (32,), False)[0]]) is None  # a bias on one only
    assert join([int8[0], parts_of("int8", 128, (32,), True)[0]]) is None  # another input


def test_the_plan_runs_the_joined_call_until_a_part_is_swapped():
    from rakv.models import load_pair
    model = load_pair("tiny", dtype="float32", weights_mode="int8").target
    plan = direct_forward.plan_of(model)
    layer = plan.layers[0]
    assert layer.qkv is not None and layer.gate_up is not None
    assert layer.qkv.current((layer.q, layer.k, layer.v))
    saved = layer.k.forward
    layer.k.forward = lambda x: saved(x)  # a kernel swapped in later
    try:
        assert not layer.qkv.current((layer.q, layer.k, layer.v))
    finally:
        layer.k.forward = saved
