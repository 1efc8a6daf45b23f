"""KV bytes on the wire: exact round trips for every dtype the feed carries, from strided slices too."""

from __future__ import annotations

import pytest
import torch

from specserve.errors import InvalidArgument
from specserve.serving.tensor_convert import kv_from_bytes, kv_to_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_strided_slice_round_trips_exactly(dtype) -> None:
    cache = torch.randn(3, 40, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # [H, capacity, D]
    window = cache[:, 5:17]  # [H, 12, D], not contiguous: what the feed sends
    assert not window.is_contiguous()
    data = kv_to_bytes(window)
    assert len(data) == window.numel() * window.element_size()
    assert torch.equal(kv_from_bytes(data, dtype, 3, 12, 8), window)


def test_a_wrong_size_is_refused() -> None:
    data = kv_to_bytes(torch.zeros(2, 3, 4))
    with pytest.raises(InvalidArgument):
        kv_from_bytes(data, torch.float32, 2, 4, 4)
