"""The speculative loop on tiny random models: lossless greedy and sampling, edge cases, seeding."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare
from seeded_runs import seeded_runs
from tiny_llama import exact_joint_of_tokens_2_and_3, noisy_copy, tiny_llama

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.results import FinishReason
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256


@pytest.fixture(scope="module")
def target():
    return ModelRunner(tiny_llama())


@pytest.fixture(scope="module")
def draft(target):
    return ModelRunner(noisy_copy(target.model, scale=0.6))


def run(target, drafter_runner, shape, params, seed=0, eos=frozenset(), prompt=PROMPT, max_new_tokens=40):
    finish = FinishChecker(max_new_tokens, eos)
    drafter = None if drafter_runner is None else ModelDrafter(drafter_runner, CAPACITY, shape, params)
    verifier = LocalVerifier(target, CAPACITY, sampling=params)
    stats = speculative_generate(prompt, verifier, drafter, seed, finish)
    return finish, stats


GREEDY = SamplingParams()
SHAPES = [
    DraftShape(depth=0),
    DraftShape(depth=1),
    DraftShape(depth=4),
    DraftShape(depth=4, widths=(3, 2)),
    DraftShape(depth=6, widths=(2, 2, 2, 2, 2, 2)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_output_equals_target_alone(target, draft, shape):
    reference, _ = run(target, None, None, GREEDY)
    finish, stats = run(target, draft, shape, GREEDY)
    assert finish.generated == reference.generated
    if shape.depth:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths exercised


def test_target_alone_matches_hf_generate(target):
    reference, stats = run(target, None, None, GREEDY)
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False)
    assert reference.generated == out[0, len(PROMPT) :].tolist()
    assert stats.mean_accepted_length == 1.0


def test_all_accepted_when_draft_is_the_target(target):
    _, stats = run(target, target, DraftShape(depth=4), GREEDY)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_accepted_length > 4  # 5 per round (4 accepted + bonus), prefill emits 1


class WrongDrafter:
    """Proposes a token the target will never choose (reference token + 1) at every depth."""

    def __init__(self, reference: list[int], prompt_len: int, vocab: int) -> None:
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        nxt = len(token_ids) - self.prompt_len
        wrong = [(t + 1) % self.vocab for t in self.reference[nxt : nxt + 3]]
        return DraftTree(TokenTree.chain([token_ids[-1], *wrong]))

    def observe(self, outcome) -> None: ...

    def release(self) -> None: ...


def test_first_token_rejected_every_round(target):
    reference, _ = run(target, None, None, GREEDY)
    finish = FinishChecker(40)
    drafter = WrongDrafter(reference.generated, len(PROMPT), target.vocab_size)
    stats = speculative_generate(PROMPT, LocalVerifier(target, CAPACITY), drafter, 0, finish)
    assert finish.generated == reference.generated
    assert stats.num_accepted_tokens == 0 and stats.num_draft_tokens > 0


def test_eos_inside_an_accepted_block(target):
    reference, _ = run(target, None, None, GREEDY)
    eos = reference.generated[6]  # the all-accepting draft accepts it in the middle of a block
    first = reference.generated.index(eos)
    finish, _ = run(target, target, DraftShape(depth=4), GREEDY, eos=frozenset({eos}))
    assert finish.generated == reference.generated[: first + 1]
    assert finish.reason is FinishReason.EOS


def test_max_tokens_inside_an_accepted_block(target):
    reference, _ = run(target, None, None, GREEDY)
    finish, _ = run(target, target, DraftShape(depth=4), GREEDY, max_new_tokens=7)
    assert finish.generated == reference.generated[:7]
    assert finish.reason is FinishReason.LENGTH


@pytest.mark.parametrize("kind", list(CandidateKind))
def test_sampling_is_seeded(target, draft, kind):
    params = SamplingParams(temperature=1.0)
    shape = DraftShape(depth=3, widths=(2, 2), sampled_kind=kind)
    a, _ = run(target, draft, shape, params, seed=11, max_new_tokens=24)
    b, _ = run(target, draft, shape, params, seed=11, max_new_tokens=24)
    c, _ = run(target, draft, shape, params, seed=12, max_new_tokens=24)
    assert a.generated == b.generated != c.generated


# --- statistical losslessness of the whole loop, on a 4-token vocabulary -----------------------

V = 4


@pytest.fixture(scope="module")
def small_target():
    return ModelRunner(tiny_llama(vocab_size=V, hidden=16, layers=1, seed=3))


@pytest.fixture(scope="module")
def small_draft(small_target):
    return ModelRunner(noisy_copy(small_target.model, scale=1.0, seed=4))


@pytest.mark.compute_only
@pytest.mark.parametrize(
    "shape",
    [
        DraftShape(depth=2, sampled_kind=CandidateKind.SAMPLED),
        DraftShape(depth=2, widths=(3, 2), sampled_kind=CandidateKind.SAMPLED_WITHOUT_REPLACEMENT),
        DraftShape(depth=2, widths=(2, 2), sampled_kind=CandidateKind.FIXED),
    ],
    ids=lambda s: s.sampled_kind.value,
)
def test_speculative_sampling_preserves_target_distribution(small_target, small_draft, shape):
    """Tokens 2 and 3 come from the first speculative round (token 1 comes from the prefill)."""
    prompt = [1, 2, 3, 0, 1]
    params = SamplingParams(temperature=1.0)
    trials = 3000

    def tokens(seed: int) -> list[int]:
        finish, _ = run(small_target, small_draft, shape, params, seed=seed, prompt=prompt, max_new_tokens=3)
        return finish.generated

    counts = torch.zeros(V, V)
    for generated in seeded_runs(tokens, trials):
        counts[generated[1], generated[2]] += 1
    expected = exact_joint_of_tokens_2_and_3(small_target.model, prompt, params, V) * trials
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"


def test_each_round_hands_the_drafter_the_batch_its_caller_counts(target):
    """The loop asks its caller how many sessions share the target's forwards once per round and
    passes that number to the drafter's propose (cost policies size the round by it); alone it is 1."""

    class Recording:
        def __init__(self) -> None:
            self.batches: list[int] = []

        def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
            self.batches.append(batch_sessions)
            return DraftTree(TokenTree.chain([token_ids[-1], 1]))  # a token each round: never backed off

        def observe(self, outcome) -> None: ...

        def release(self) -> None: ...

    counts = iter(range(1, 100))
    crowded, alone = Recording(), Recording()
    for drafter, batch_sessions in ((crowded, lambda: next(counts)), (alone, None)):
        verifier = LocalVerifier(target, CAPACITY, sampling=GREEDY)
        speculative_generate(PROMPT, verifier, drafter, 0, FinishChecker(6), batch_sessions=batch_sessions)
    rounds = len(crowded.batches)  # the prefill emits the first token; each round then 1 or 2
    assert rounds >= 3 and crowded.batches == list(range(1, rounds + 1))  # one count per round, in order
    assert alone.batches == [1] * len(alone.batches)
