"""MCSD's sliced mask: every slice equals a mask built from scratch for the tree that round drafted."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.sliced_mask import MAX_SLICED_NODES, multi_candidate_parents, sliced_tree_mask
from specserve.core.tree import TokenTree, tree_children, tree_depths
from specserve.core.tree_mask import tree_attention_mask
from specserve.errors import InvalidArgument

SHAPES = [(4, 2, 2), (2, 4, 3, 1, 1), (3,), (1, 1, 1)]


def expected_num_nodes(shape: tuple[int, ...], j: int) -> int:
    return sum(math.prod(shape[:d]) for d in range(j + 1))  # 1 + k1 + k1 k2 + ...


def test_worked_example_by_hand():
    full = sliced_tree_mask((2, 2))
    assert full.parent_ids == (-1, 0, 0, 1, 1, 2, 2)
    assert full.depths.tolist() == [0, 1, 1, 2, 2, 2, 2]
    parents, mask, depths = full.levels(1)
    assert parents == (-1, 0, 0)
    assert torch.equal(mask, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    assert depths.tolist() == [0, 1, 1]
    # node 6 = level 2 offset 3 + parent_local 1 * k 2 + child 1: under node 2
    assert full.mask[6].tolist() == [True, False, True, False, False, False, True]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_slice_equals_a_fresh_mask(shape):
    full = sliced_tree_mask(shape)
    assert full.gamma == len(shape)
    for j in range(len(shape) + 1):
        n = expected_num_nodes(shape, j)
        parents, mask, depths = full.levels(j)
        assert full.num_nodes(j) == n == len(parents) == mask.shape[0] == mask.shape[1] == depths.shape[0]
        tree = TokenTree(tuple(range(n)), parents)  # a valid tree: parents precede children
        assert torch.equal(mask, tree_attention_mask(tree.parent_ids))
        assert depths.tolist() == tree_depths(parents) == (mask.sum(dim=-1) - 1).tolist()
        assert parents == full.parent_ids[:n]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_node_at_depth_d_has_k_d_children(shape):
    full = sliced_tree_mask(shape)
    tree = TokenTree(tuple(range(len(full.parent_ids))), full.parent_ids)
    depths = tree.depths()
    for node, children in enumerate(tree_children(tree.parent_ids)):
        expected = shape[depths[node]] if depths[node] < len(shape) else 0
        assert len(children) == expected
        if expected:  # siblings are numbered consecutively
            assert children == list(range(children[0], children[0] + expected))


def test_node_counts():
    full = sliced_tree_mask((4, 2, 2))
    assert [full.num_nodes(j) for j in range(4)] == [1, 5, 13, 29]  # MCSD's (4,2,2): 28 draft tokens
    assert [sliced_tree_mask((2, 4, 3, 1, 1)).num_nodes(j) for j in range(6)] == [1, 3, 11, 35, 59, 83]


def test_slices_are_views_of_one_cached_build():
    full = sliced_tree_mask((4, 2, 2))
    assert sliced_tree_mask([4, 2, 2]) is full  # cached per shape, whatever the sequence type
    _, mask, depths = full.levels(2)
    assert mask.untyped_storage().data_ptr() == full.mask.untyped_storage().data_ptr()
    assert mask.data_ptr() == full.mask.data_ptr() and not mask.is_contiguous()  # a strided block
    assert depths.data_ptr() == full.depths.data_ptr()
    _, root_mask, _ = full.levels(0)
    assert root_mask.tolist() == [[True]]


def test_parents_helper_matches_the_cached_tree():
    assert multi_candidate_parents((3,)) == (-1, 0, 0, 0)
    assert multi_candidate_parents((1, 1, 1)) == (-1, 0, 1, 2)  # a chain
    assert multi_candidate_parents((2, 4, 3, 1, 1)) == sliced_tree_mask((2, 4, 3, 1, 1)).parent_ids


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 1), (-1,), (2.0,), (True, 2), (64, 64, 64)])
def test_invalid_shapes_rejected(shape):
    with pytest.raises(InvalidArgument):
        sliced_tree_mask(shape)


def test_size_limit_counts_every_level():
    assert MAX_SLICED_NODES == 64 * 64  # the leaves alone would fit; with the root and level 1 they do not
    with pytest.raises(InvalidArgument, match="4161 nodes"):
        sliced_tree_mask((64, 64))
