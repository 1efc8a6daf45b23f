"""Tensors on the wire: KV bytes round trip exactly for every dtype the feed carries, from strided slices
too; a sampled tree's q goes sparse and comes back dense at the target."""

from __future__ import annotations

import pytest
import torch

from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.tree import TokenTree
from specserve.errors import InvalidArgument
from specserve.serving.convert import tree_from_pb, tree_to_pb
from specserve.serving.tensor_convert import draft_to_pb, kv_from_bytes, kv_to_bytes, with_dense_probs


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


def test_a_sampled_trees_q_goes_sparse_and_comes_back_dense() -> None:
    q = torch.zeros(16)
    q[[3, 9, 12]] = torch.tensor([0.5, 0.25, 0.25])  # [V]
    drafted = DraftTree(TokenTree((1, 3, 9), (-1, 0, 0)), CandidateKind.SAMPLED, {0: q})
    message = draft_to_pb(drafted)
    assert list(message.draft_probs[0].token_ids) == [3, 9, 12]  # only the non-zero entries travel
    structure = tree_from_pb(message, max_nodes=8)  # what the router and the target validate
    assert not structure.draft_probs
    dense = with_dense_probs(structure, message, 16, torch.device("cpu"))
    assert dense.tree == drafted.tree and dense.kind is drafted.kind
    assert torch.equal(dense.draft_probs[0], q)


def test_a_tree_with_tensors_is_not_sent_as_structure_alone() -> None:
    drafted = DraftTree(TokenTree((1, 3), (-1, 0)), CandidateKind.SAMPLED, {0: torch.ones(4) / 4})
    with pytest.raises(TypeError):
        tree_to_pb(drafted)
