"""Row-exact attention (rakv.row_attention, attention_kernel.c): a row's bits do not
depend on how many rows come with it, on the kernel's vector and portable paths alike,
and it is attention (close to PyTorch's)."""
from __future__ import annotations

import pytest
import torch

from conftest import NEEDS_KERNELS, kernel_paths
from rakv.kernels import kernel_or_none
from rakv import row_attention

pytestmark = NEEDS_KERNELS  # the kernel's library: built where a C compiler is

# (heads, kv_heads, dim): SmolLM2, Qwen2.5-Coder 1.5B and 0.5B, the tiny pair, a dim the
# vector path does not take
SHAPES = [(9, 3, 64), (12, 2, 128), (14, 2, 64), (4, 2, 16), (3, 1, 24)]


def qkv(heads: int, kv_heads: int, dim: int, rows: int, kv_length: int, seed: int):
    """HF's layouts: query [1, heads, T, dim] a transposed view (as rotary embedding leaves
    it), key/value [1, kv_heads, L, dim] contiguous (as the cache holds them)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, heads, dim, generator=generator).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, kv_length, dim, generator=generator) for _ in range(2))
    return query, key * 3, value


def attend(query, key, value):
    return row_attention.kernel_attention(kernel_or_none(), query, key, value, None)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_alone_or_with_up_to_16_others(shape):
    heads, kv_heads, dim = shape
    query, key, value = qkv(heads, kv_heads, dim, 17, 300, seed=dim + heads)
    alone = torch.cat([attend(query[:, :, i:i + 1], key[:, :, :300 - 16 + i], value[:, :, :300 - 16 + i])
                       for i in range(17)], dim=1)  # [1, 17, heads, dim]
    for rows in (2, 3, 5, 9, 17):
        together = attend(query[:, :, 17 - rows:], key, value)
        assert torch.equal(together, alone[:, 17 - rows:]), rows


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_gives_the_same_bits(shape, path, monkeypatch):
    query, key, value = qkv(*shape, rows=9, kv_length=77, seed=3)
    monkeypatch.setattr(row_attention, "PATH", 0)
    portable = attend(query, key, value)
    monkeypatch.setattr(row_attention, "PATH", path)
    assert torch.equal(attend(query, key, value), portable)


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_gives_the_same_bits_on_rows_of_1_to_17_keys(shape, path, monkeypatch):
    """A vector path's blocks of 8 or 16 keys part full from the first key on, and scores
    spread past exp's cutoff (keys 10 times larger: some p[j] are 0)."""
    query, key, value = qkv(*shape, rows=17, kv_length=17, seed=11)
    key = key * 10
    monkeypatch.setattr(row_attention, "PATH", 0)
    portable = attend(query, key, value)
    monkeypatch.setattr(row_attention, "PATH", path)
    assert torch.equal(attend(query, key, value), portable)


@pytest.mark.parametrize("shape", SHAPES)
def test_it_is_causal_attention(shape):
    heads, kv_heads, dim = shape
    query, key, value = qkv(heads, kv_heads, dim, 9, 40, seed=5)
    mask = torch.ones(9, 40, dtype=torch.bool).tril(40 - 9)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                            enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, key, value), want, rtol=1e-5, atol=1e-5)  # values ~1


def test_threads_do_not_change_the_bits():
    query, key, value = qkv(12, 2, 128, rows=9, kv_length=100, seed=7)
    one = attend(query, key, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(attend(query, key, value), one)
    finally:
        torch.set_num_threads(threads)
