"""rakv.kv_cache: a cache that appends in place holds what DynamicCache holds, bit for bit."""
import torch
from transformers import DynamicCache

from rakv.kv_cache import MIN_CAPACITY, GrowingCache


def states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, length, 8, generator=generator), torch.randn(1, 2, length, 8, generator=generator)


def test_appends_and_crops_hold_what_dynamic_cache_holds():
    growing, dynamic = GrowingCache(), DynamicCache()
    for step, (length, crop) in enumerate([(30, 0), (1, 0), (5, 3), (40, 0), (1, 1), (9, 0), (100, 7)]):
        for layer in range(2):
            keys, values = growing.update(*states(length, 10 * step + layer), layer)
            expected = dynamic.update(*states(length, 10 * step + layer), layer)
            assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])  # every position
        if crop:
            growing.crop(-crop)
            dynamic.crop(-crop)
        assert growing.get_seq_length() == dynamic.get_seq_length()
        for mine, theirs in zip(growing.layers, dynamic.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert isinstance(growing, DynamicCache)


def test_appending_writes_in_place_until_the_capacity_doubles():
    cache = GrowingCache()
    cache.update(*states(10, 0), 0)
    buffer = cache.layers[0].buffers[0]
    assert buffer.shape[-2] == MIN_CAPACITY
    for step in range(MIN_CAPACITY - 10):
        cache.update(*states(1, step + 1), 0)
        assert cache.layers[0].keys.data_ptr() == buffer.data_ptr()  # no copy
    cache.update(*states(1, 99), 0)
    assert cache.layers[0].buffers[0].shape[-2] == 2 * MIN_CAPACITY
    assert cache.get_seq_length() == MIN_CAPACITY + 1


def test_a_restored_prefix_is_copied_in():
    keys, values = states(12, 5)
    cache = GrowingCache([(keys[:, :, :7], values[:, :, :7])])
    assert cache.get_seq_length() == 7
    assert torch.equal(cache.layers[0].keys, keys[:, :, :7])
    keys[:] = 0  # the cache owns its copy
    assert cache.layers[0].keys.abs().sum() > 0
