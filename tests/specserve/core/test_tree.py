import pytest
import torch

from specserve.core.tree import (
    TokenTree,
    tree_children,
    tree_depths,
)
from specserve.core.tree_mask import tree_attention_mask
from specserve.errors import InvalidArgument

# root r with children a, b; a has child c (the worked example in tree.py)
PARENTS = (-1, 0, 0, 1)


def test_depths_children_paths():
    assert tree_depths(PARENTS) == [0, 1, 1, 2]
    assert tree_children(PARENTS) == [[1, 2], [3], [], []]


def test_mask_is_ancestor_or_self():
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree_attention_mask(PARENTS), expected)


def test_chain_mask_is_causal():
    tree = TokenTree.chain([5, 6, 7, 8])
    assert tree.is_chain()
    assert torch.equal(tree_attention_mask(tree.parent_ids), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 0, 3, 0), ()])
def test_invalid_parents_rejected(parents):
    with pytest.raises(InvalidArgument):
        TokenTree(tuple(range(len(parents))), parents)
