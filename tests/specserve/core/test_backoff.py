"""The loop stops asking a drafter that proposes nothing, for a doubling run of rounds, and output
stays the target's own."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tiny_llama import noisy_copy, tiny_llama

from specserve.core.backoff import DraftBackoff
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import DraftTree
from specserve.core.sampling_params import SamplingParams
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256


def asked_rounds(proposals: Sequence[int], rounds: int, max_skip: int = 8) -> list[int]:
    """The rounds a drafter is asked in, when its n-th proposal has proposals[n] draft tokens."""
    backoff, asked, sizes = DraftBackoff(max_skip), [], iter(proposals)
    for index in range(rounds):
        if backoff.should_ask():
            asked.append(index)
            backoff.observe(next(sizes))
    return asked


def test_empty_proposals_double_the_skipped_run_up_to_the_cap() -> None:
    # skipped runs after each empty proposal: 1, 2, 4, 4, 4 (cap 4)
    assert asked_rounds([0] * 10, 25, max_skip=4) == [0, 2, 5, 10, 15, 20]


def test_a_proposal_with_draft_tokens_resets_the_run() -> None:
    # empty, empty (skip 1 then 2), drafted (no skip), empty (skip 1 again)
    assert asked_rounds([0, 0, 3, 0, 2, 2], 10) == [0, 2, 5, 6, 8, 9]


class EmptyUntil:
    """Proposes the root alone until round `start`, then what the wrapped drafter proposes."""

    def __init__(self, inner: ModelDrafter, start_position: int) -> None:
        self.inner, self.start_position = inner, start_position
        self.positions: list[int] = []

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self.positions.append(len(token_ids))
        if len(token_ids) < self.start_position:
            return DraftTree.root_only(token_ids[-1])
        return self.inner.propose(token_ids, round_seed, batch_sessions)

    def observe(self, outcome) -> None:
        self.inner.observe(outcome)

    def release(self) -> None:
        self.inner.release()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_skipped_rounds_verify_the_root_alone_and_the_drafter_catches_up(temperature: float) -> None:
    target = ModelRunner(tiny_llama())
    draft = ModelRunner(noisy_copy(target.model, scale=0.6))
    params = SamplingParams(temperature=temperature)

    def run(drafter):
        finish = FinishChecker(40, frozenset())
        verifier = LocalVerifier(target, CAPACITY, sampling=params)
        stats = speculative_generate(PROMPT, verifier, drafter, 7, finish)
        return finish.generated, stats

    alone, _ = run(None)
    drafter = EmptyUntil(ModelDrafter(draft, CAPACITY, DraftShape(depth=3), params), len(PROMPT) + 12)
    generated, stats = run(drafter)
    # Plain decoding (one token a round) while the drafter proposes nothing: asked at rounds 0, 2, 5,
    # 10, 19; it drafts from the last of these on, asked every round, from a longer history.
    start = len(PROMPT) + 1
    assert drafter.positions[:5] == [start, start + 2, start + 5, start + 10, start + 19]
    assert stats.num_draft_tokens > 0
    if temperature == 0.0:
        assert generated == alone
    else:  # a root-alone round samples as the target does: same seed, same tokens until drafts start
        assert generated[:20] == alone[:20]


def test_skipped_rounds_that_ran_elsewhere_are_used_up():
    backoff = DraftBackoff()
    backoff.skip(8)
    assert backoff.left == 0
    for _ in range(3):
        backoff.observe(0)  # runs of 1, 2, then 4 rounds to skip
    assert backoff.left == 4
    backoff.skip(3)
    assert backoff.left == 1 and not backoff.should_ask()  # the last skipped round
    assert backoff.should_ask()  # the run is over: the drafter is asked again
    backoff.observe(0)
    backoff.skip(20)
    assert backoff.left == 0


def test_rounds_that_ran_elsewhere_are_followed_as_the_loop_would_have_run_them():
    proposals = [0, 0, 3, 0, 0, 0, 2, 0, 0]  # the draft tokens of each proposal, in turn
    here = DraftBackoff()
    asked_here, sizes = [], iter(proposals)
    for index in range(20):
        if here.should_ask():
            asked_here.append(index)
            here.observe(next(sizes))
    # The same rounds run elsewhere, each as the tree it verified: the root alone where skipped
    sizes = iter(proposals)
    ran = [next(sizes) if index in asked_here else 0 for index in range(20)]
    there = DraftBackoff()
    asked_there = [index for index, size in enumerate(ran) if there.follow(size)]
    # skipped runs of 1 and 2, a proposal resets, then 1, 2, 4; another proposal, then 1
    assert asked_there == asked_here == [0, 2, 5, 6, 8, 11, 16, 17, 19]
    assert (there.run, there.left) == (here.run, here.left)
    there.hold_off()  # as after a long run of empty proposals
    assert there.left == there.run == there.max_skip
