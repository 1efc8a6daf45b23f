"""CaPE widths: hand-checkable bins, the tree-size cap."""

from __future__ import annotations

import pytest
import torch

from specserve.core.cape import CAPE_BINS, CapeSettings, cape_width, draft_confidence, fit_width
from specserve.errors import InvalidArgument


def test_official_bins_by_hand():
    assert [cape_width(c) for c in [0.05, 0.35, 0.65, 0.95]] == [8, 6, 4, 2]
    assert [cape_width(c) for c in [0.0, 0.29, 0.3, 0.59, 0.6, 0.79, 0.8]] == [8, 8, 6, 6, 4, 4, 2]


def test_full_confidence_takes_the_last_bin():
    assert cape_width(1.0) == CAPE_BINS[-1] == 2
    ten_bins = tuple(range(1, 11))  # floor(10 * 1.0) = 10 is past the end: clamp to the last
    assert cape_width(1.0, ten_bins) == 10
    assert cape_width(1.0000001, ten_bins) == 10
    assert cape_width(0.95, ten_bins) == 10 and cape_width(0.05, ten_bins) == 1


def test_confidence_is_the_top_probability_at_temperature_one():
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    assert draft_confidence(logits) == pytest.approx(0.6)
    assert draft_confidence(logits * 5) > 0.6  # no temperature: the raw logits decide


@pytest.mark.parametrize(
    "width,num_nodes,depths_after,cap,expected",
    [
        (8, 1, 3, 64, 8),  # room to spare
        (8, 1, 3, 7, 3),  # 7 - 1 node - 3 spine nodes kept for later depths
        (8, 5, 1, 7, 1),  # only the spine fits
        (8, 6, 2, 7, 1),  # depth beats width: the spine still goes one step deeper
        (8, 7, 0, 7, 0),  # full: stop drafting
    ],
)
def test_fit_width(width, num_nodes, depths_after, cap, expected):
    assert fit_width(width, num_nodes, depths_after, cap) == expected


def test_settings_are_validated():
    with pytest.raises(InvalidArgument):
        CapeSettings(bins=())
    with pytest.raises(InvalidArgument):
        CapeSettings(bins=(2, 0))
    with pytest.raises(InvalidArgument):
        CapeSettings(max_tree_nodes=0)
