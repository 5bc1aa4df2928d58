"""Rotary embedding and RMSNorm on the C kernel (rakv.layer_kernel): the rotary
embedding is Hugging Face's bit for bit, the norm's rows never mix, and the vector and
portable paths agree."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import NEEDS_KERNELS, kernel_paths
from rakv.kernels import kernel_or_none
from rakv import layer_kernel

pytestmark = NEEDS_KERNELS  # the kernel's library: built where a C compiler is


def rotary_inputs(heads: int, kv_heads: int, dim: int, rows: int, seed: int):
    """As a layer has them: query and key views of Linear outputs, cos/sin of HF's form."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, heads * dim, generator=generator).view(1, rows, heads, dim).transpose(1, 2)
    key = torch.randn(1, rows, kv_heads * dim, generator=generator).view(1, rows, kv_heads, dim).transpose(1, 2)
    positions = torch.arange(300, 300 + rows, dtype=torch.float32)[:, None]
    freqs = positions / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.cat((freqs, freqs), dim=-1)[None, None]  # [1, 1, T, dim]
    return query, key, angles.cos(), angles.sin()


@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (14, 2, 64), (3, 1, 24)])
@pytest.mark.parametrize("path", kernel_paths())
def test_rope_is_hugging_faces_bit_for_bit(shape, path, monkeypatch):
    monkeypatch.setattr(layer_kernel, "PATH", path)
    query, key, cos, sin = rotary_inputs(*shape, rows=9, seed=sum(shape))
    got = layer_kernel.rope(kernel_or_none(), query, key, cos, sin)
    want = apply_rotary_pos_emb(query, key, cos[:, 0], sin[:, 0])  # it unsqueezes them itself
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Norm(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = 1e-6


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("n", [576, 896, 1536, 100])
def test_rms_norm_rows_never_mix_and_every_path_agrees(n, path, monkeypatch):
    norm = layer_kernel.KernelRMSNorm(Norm(n), kernel_or_none())
    x = torch.randn(1, 17, n, generator=torch.Generator().manual_seed(n)) * 3
    together = norm(x)
    alone = torch.cat([norm(x[:, i:i + 1]) for i in range(17)], dim=1)
    assert torch.equal(together, alone)
    monkeypatch.setattr(layer_kernel, "PATH", path)
    assert torch.equal(norm(x), together)
    variance = x.double().pow(2).mean(-1, keepdim=True)
    want = norm.weight.double() * x.double() * torch.rsqrt(variance + 1e-6)
    torch.testing.assert_close(together.double(), want, rtol=1e-6, atol=1e-6)


def test_quantized_models_norm_on_the_kernel_and_float32_on_hugging_faces():
    from rakv.models import load_pair
    quantized = load_pair("tiny", dtype="float32", weights_mode="int8")
    plain = load_pair("tiny", dtype="float32")
    assert isinstance(quantized.target.model.norm.forward, layer_kernel.KernelRMSNorm)
    assert "forward" not in vars(plain.target.model.norm)
