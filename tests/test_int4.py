"""The int4 kernel (rakv.int4) and a GGUF's 4-bit groups (rakv.gguf_groups): the kernel's
arithmetic against a float64 reference, its two paths and its threads giving the same
bits, GGUF's Q4_0, Q4_1 and Q4_K blocks read as gguf-py dequantizes them, SmolLM2's own
groups matching the weights it loads, and one-line errors where no kernel can be built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import NEEDS_KERNELS, kernel_paths
from rakv import auto_weights, gguf_groups, int4, kernels
from rakv.auto_weights import choose_weights
from rakv.weights import FP32, INT4, INT8



def reference(grouped: int4.GroupedWeight, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: per-group int8 activations times a q + b."""
    rows, inputs = x.shape
    groups = x.view(rows, inputs // int4.GROUP, int4.GROUP).double()
    scale = groups.abs().amax(dim=2, keepdim=True) / 127
    quantized = torch.round(groups / torch.where(scale > 0, scale, 1)).clamp(-127, 127)
    return (quantized * scale).view(rows, inputs) @ grouped.dequantized().double().T


@NEEDS_KERNELS
@pytest.mark.parametrize("shape", [(64, 258), (576, 192), (1536, 1536), (8960, 40)])
def test_the_kernel_computes_what_it_says(shape):
    inputs, outputs = shape
    torch.manual_seed(inputs + outputs)
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    grouped = int4.quantize_groups(linear.weight)
    layer = int4.Int4Forward(linear, grouped)
    x = torch.randn(11, inputs) * torch.linspace(0.01, 100.0, 11)[:, None]
    expected = reference(grouped, x)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(layer(torch.zeros(3, inputs)), torch.zeros(3, outputs))  # an all-zero group has scale 0


@NEEDS_KERNELS
@pytest.mark.parametrize("path", kernel_paths())
# 1536 inputs: steps, a unit per 8 groups; 96: no steps, units that are f16 subnormals
@pytest.mark.parametrize("inputs, weight_scale", [(1536, 1.0), (96, 1e-4)])
def test_every_path_and_any_threads_give_the_same_bits(inputs, weight_scale, path):
    """Each path the CPU runs, forced, gives the portable path's bits at every tile
    height, quantizing the activations with its own loop; and so do two threads."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, 600)
    grouped = int4.quantize_groups(linear.weight * weight_scale)
    layer = int4.Int4Forward(linear, grouped)
    assert (layer.a_step is None) == (grouped.per_unit == 1)
    x = torch.randn(13, inputs)
    x[0, :32] = torch.arange(32) - 15.5  # scale 1: every input a tie the paths round to even
    x[0, 31] = -127.0
    layer.path = 0
    portable = layer(x)
    torch.testing.assert_close(portable.double(), reference(grouped, x) + linear.bias.double(), rtol=1e-5,
                               atol=1e-5 * float(portable.abs().max()))
    layer.path = path
    for rows in range(1, 14):  # every tile height and pass split, and 9 + 1 .. 9 + 4
        assert torch.equal(layer(x[:rows]), portable[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(x), portable)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", gguf_groups.FOUR_BIT)
def test_gguf_blocks_read_as_gguf_py_dequantizes_them(kind):
    """Random blocks of each 4-bit type: a q + b equals gguf-py's own dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    out, inputs = 4, 512
    size = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[kind]
    per_block = 256 if kind == "Q4_K" else 32
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out, inputs // per_block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, size=(out, inputs // per_block, 2)).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(out, inputs // per_block, 4)  # finite d (and m or dmin)
    raw = raw.reshape(out, -1)
    parts = gguf_groups._groups(kind, raw, out, inputs)
    grouped = int4.GroupedWeight(*(torch.from_numpy(np.ascontiguousarray(t)) for t in parts), kind)
    expected = dequantize(raw, GGMLQuantizationType[kind]).reshape(out, inputs)
    assert torch.equal(grouped.dequantized(), torch.from_numpy(expected))


@NEEDS_KERNELS
@pytest.mark.slow
def test_smollm2_runs_its_own_q4_1_groups(smollm2_pair, tmp_path, monkeypatch):
    """Every 4-bit Linear of the SmolLM2 GGUF is taken as stored, matching the loaded
    weight bit for bit; the embedding (Q8_0) keeps the file's rows, the same bits; the
    head tied to it runs as int8."""
    from rakv import model_files
    path = model_files.resolve("smollm2")
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))  # a fresh cache: read, check and store once
    found = gguf_groups.stored_linears(path, smollm2_pair.target)
    kinds = {name: g if isinstance(g, str) else g.source for name, g in found.items()}
    assert kinds["lm_head"] == kinds["model.embed_tokens"] == "Q8_0"  # tied: stored once
    assert sum(kind == "Q4_1" for kind in kinds.values()) == len(kinds) - 2 == 210
    again = gguf_groups.stored_linears(path, smollm2_pair.target)  # from the cache now
    assert all(torch.equal(again[n].q, g.q) and torch.equal(again[n].a_unit, g.a_unit) for n, g in found.items()
               if isinstance(g, int4.GroupedWeight))
    ids = torch.tensor([[0, 5, 49151], [7, 7, 100]])
    embedding = smollm2_pair.target.model.embed_tokens
    assert isinstance(found["model.embed_tokens"], gguf_groups.StoredRows)
    assert torch.equal(again["model.embed_tokens"](ids), embedding.weight[ids])
    assert len(list((tmp_path / "converted").glob("*-groups-*.safetensors"))) == 1


def test_no_compiler_is_one_line_and_auto_falls_back(monkeypatch, tmp_path, capsys):
    """Without the library no quantized mode runs (int8 has no other arithmetic): a
    one-line error, and auto takes fp32 with a warning."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    with pytest.raises(kernels.KernelUnavailable, match="the quantized modes need a C compiler"):
        kernels._library.__wrapped__()
    monkeypatch.setattr(auto_weights, "kernel", kernels._library.__wrapped__)
    model = torch.nn.Linear(64, 64)
    for mode in (INT4, INT8):
        with pytest.raises(kernels.KernelUnavailable, match=f"^--weights {mode}: the quantized modes need a C"):
            choose_weights(mode, [{}], [model])
    stored = [{"": int4.quantize_groups(model.weight)}]
    assert choose_weights("auto", stored, [model]) == FP32
    assert "warning: the quantized modes need a C compiler" in capsys.readouterr().err


def test_a_kernel_path_cap_that_is_no_path_is_one_line(monkeypatch):
    monkeypatch.setenv(kernels.PATH_ENV, "avx3")
    with pytest.raises(kernels.KernelUnavailable, match="^RAKV_KERNEL_PATH must be one of portable, avx2, vnni256"):
        kernels.kernel.__wrapped__()
