"""The float64 copy of the KV cache kept for exact attention: the same values as converting the cache
whole, through growth, a committed tree path, truncation, and positions a plain update wrote."""

from __future__ import annotations

import torch

from specserve.runtime.kv_cache import MIN_ALLOCATION, PositionalKVCache


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)  # [B, H, n, D]


def assert_shadow_is_the_cache(cache: PositionalKVCache) -> None:
    layer = cache.positional_layers[0]
    keys, values = cache.layer_kv(0)
    assert layer.exact_length == layer.length
    assert layer.exact is not None
    exact_keys, exact_values = layer.exact
    assert torch.equal(exact_keys[:, :, : layer.length], keys.double())
    assert torch.equal(exact_values[:, :, : layer.length], values.double())


def test_the_float64_copy_follows_growth_commits_and_truncation():
    cache = PositionalKVCache(num_layers=1, capacity=4 * MIN_ALLOCATION)
    layer = cache.positional_layers[0]
    keys, _ = layer.update_exact(*kv(MIN_ALLOCATION - 2, 0))  # prefill
    assert keys.dtype == torch.float64 and keys.shape == (1, 2, MIN_ALLOCATION - 2, 8)
    assert_shadow_is_the_cache(cache)
    # a tree of 5 nodes crosses the first allocation: both buffers grow, nothing written is lost
    start = cache.length
    keys, _ = layer.update_exact(*kv(5, 1))
    assert layer.allocated > MIN_ALLOCATION and keys.shape[2] == start + 5
    cache.commit_path(start, [0, 2, 4])  # a path that is not a chain prefix: slots move down
    assert cache.length == start + 3
    assert_shadow_is_the_cache(cache)
    cache.truncate(start + 1)
    layer.update_exact(*kv(2, 2))
    assert_shadow_is_the_cache(cache)


def test_positions_written_by_a_plain_update_are_converted_when_next_read_exactly():
    cache = PositionalKVCache(num_layers=1, capacity=64)
    layer = cache.positional_layers[0]
    layer.update_exact(*kv(3, 0))
    layer.update(*kv(4, 1))  # another path wrote these
    keys, _ = layer.update_exact(*kv(2, 2))
    assert keys.shape[2] == 9
    assert_shadow_is_the_cache(cache)
