"""LocalVerifier keeps the committed token ids next to its cache (the KV feed sends them to drafts)."""

from __future__ import annotations

import pytest

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.sampling_params import SamplingParams
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.mcsd import McsdShape, MultiCandidateDrafter
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256


class CheckedVerifier(LocalVerifier):
    """Checks the invariant after every commit: one id per cached position, plus the root."""

    def verify(self, draft, round_seed):
        outcome = super().verify(draft, round_seed)
        assert len(self.token_ids) == self.cache.length + 1
        assert self.root_token == self.token_ids[-1]
        return outcome


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize(
    "make_drafter",
    [
        pytest.param(
            lambda d, s: ModelDrafter(d, CAPACITY, DraftShape(depth=4, widths=(2, 2)), s), id="tree"
        ),
        # target-rooted rounds commit no token after the path: the root stays the last id
        pytest.param(
            lambda d, s: MultiCandidateDrafter(d, CAPACITY, McsdShape((2, 2, 1), target_roots=True), s),
            id="target-rooted",
        ),
    ],
)
def test_token_ids_are_the_committed_sequence(target, draft, make_drafter, temperature):
    params = SamplingParams(temperature=temperature)
    verifier = CheckedVerifier(target, CAPACITY, sampling=params)
    finish = FinishChecker(40, frozenset())
    speculative_generate(PROMPT, verifier, make_drafter(draft, params), 5, finish)
    committed = [*PROMPT, *finish.generated]
    # the last round may commit past max_new_tokens; the loop emits only up to it
    assert verifier.token_ids[: len(committed)] == committed


def test_resume_and_release(target):
    verifier = LocalVerifier(target, CAPACITY)
    verifier.resume([*PROMPT, 7])
    assert verifier.token_ids == [*PROMPT, 7] and verifier.cache.length == len(PROMPT)
    verifier.release()
    assert verifier.token_ids == [] and verifier.root_token is None
