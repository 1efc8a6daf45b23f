"""One ragged forward over many sessions equals each session's own forward (float32 tolerance), through
transformers' module forward (the lean one: test_decoder.py); chains and trees on each architecture."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import EACH_ARCHITECTURE, tiny_model

from specserve.errors import ResourceExhausted
from specserve.runtime.kv_cache import MIN_ALLOCATION
from specserve.runtime.ragged import forward_ragged
from specserve.runtime.runner import ModelRunner
from specserve.runtime.segment import Segment, causal_attend

ATOL = 1e-4


@pytest.fixture(scope="module")
def runner(architecture) -> ModelRunner:
    return ModelRunner(tiny_model(architecture, layers=3))


def reference_logits(runner: ModelRunner, sequence: list[int]) -> torch.Tensor:
    """[n, V] from transformers' own forward over the whole sequence, no cache of ours."""
    with torch.inference_mode():
        return runner.model(input_ids=torch.tensor([sequence])).logits[0]


@EACH_ARCHITECTURE
def test_chains_and_prefill_chunks_of_different_lengths(runner):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    caches = [runner.new_cache(64) for _ in prompts]
    # first forward: a different-length prefix of each (prefill chunks), then the rest in one forward
    splits = [3, 1, 6]
    first = forward_ragged(
        runner.model,
        [
            Segment(c, p[:k], torch.arange(k), causal_attend(0, k, runner.device))
            for c, p, k in zip(caches, prompts, splits, strict=True)
        ],
    )
    second = forward_ragged(
        runner.model,
        [
            Segment(c, p[k:], torch.arange(k, len(p)), None)
            for c, p, k in zip(caches, prompts, splits, strict=True)
        ],
    )
    for prompt, a, b in zip(prompts, first, second, strict=True):
        torch.testing.assert_close(torch.cat([a, b]), reference_logits(runner, prompt), atol=ATOL, rtol=0)


@EACH_ARCHITECTURE
def test_trees_beside_chains_equal_their_paths(runner):
    """A tree's node sees its prefix and ancestors only: its logits equal the path run as a sequence."""
    tree_cache, chain_cache, single_cache = (runner.new_cache(64) for _ in range(3))
    for cache, prompt in ((tree_cache, [5, 6, 7]), (chain_cache, [1, 2]), (single_cache, [40, 41, 42, 43])):
        runner.forward(cache, prompt)
    tree_ids, parents = [8, 10, 11, 12, 13], [-1, 0, 0, 1, 2]
    depths = torch.tensor([0, 1, 1, 2, 2])
    tree_mask = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
        dtype=torch.bool,
    )
    attend = torch.cat([torch.ones(5, 3, dtype=torch.bool), tree_mask], dim=1)
    tree, chain, single = forward_ragged(
        runner.model,
        [
            Segment(tree_cache, tree_ids, 3 + depths, attend),
            Segment(chain_cache, [3, 4, 5], torch.arange(2, 5), None),
            Segment(single_cache, [44], torch.tensor([4]), None, last_only=True),
        ],
    )
    full = reference_logits(runner, [5, 6, 7, 8, 11, 13])
    torch.testing.assert_close(tree[[0, 2, 4]], full[3:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(tree[3], reference_logits(runner, [5, 6, 7, 8, 10, 12])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(chain, reference_logits(runner, [1, 2, 3, 4, 5])[2:], atol=ATOL, rtol=0)
    assert single.shape == (runner.vocab_size,)
    torch.testing.assert_close(single, reference_logits(runner, [40, 41, 42, 43, 44])[-1], atol=ATOL, rtol=0)
    assert parents  # the tree above, in parent indices


def test_runner_tree_forward_matches_the_ragged_segment(runner):
    a, b = runner.new_cache(32), runner.new_cache(32)
    runner.forward(a, [1, 2, 3])
    runner.forward(b, [1, 2, 3])
    via_runner = runner.forward(a, [4, 5, 6], [-1, 0, 0])
    full = reference_logits(runner, [1, 2, 3, 4, 6])
    torch.testing.assert_close(via_runner[[0, 2]], full[3:], atol=ATOL, rtol=0)


def test_cache_grows_by_need_and_stops_at_capacity(runner):
    cache = runner.new_cache(MIN_ALLOCATION * 3)
    runner.forward(cache, [1, 2, 3])
    assert cache.allocated == MIN_ALLOCATION  # a short session holds little
    filler = [i % 60 for i in range(MIN_ALLOCATION)]
    runner.forward(cache, filler)  # grows past the first allocation
    assert cache.allocated == 2 * MIN_ALLOCATION
    logits = runner.forward(cache, [7], last_only=True)
    sequence = [1, 2, 3, *filler, 7]
    torch.testing.assert_close(logits, reference_logits(runner, sequence)[-1], atol=ATOL, rtol=0)
    with pytest.raises(ResourceExhausted):
        runner.forward(cache, [1] * (3 * MIN_ALLOCATION))
