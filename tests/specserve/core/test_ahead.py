"""Rounds a verifier runs on its own after the one it is given (core/ahead.py), on a tiny random target:
the output stays the target's own, and they stop where the plan, the token budget, an end-of-sequence
token or the KV room says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from tiny_llama import tiny_llama

from specserve.core.ahead import Round, committed_tokens, run_ahead
from specserve.core.cost import NOMINAL_CPU_COST, CostModel
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import MAX_AHEAD_ROUNDS, AheadPlan, DraftTree, SuffixTrust, VerifyOutcome
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.suffix_drafter import SuffixDrafter, WorthBook, WorthPriors, suffix_drafter
from specserve.core.tree import TokenTree
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8, 3, 17, 5, 9]
CAPACITY = 256
MAX_NODES = 16


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return ModelRunner(tiny_llama())


class AheadLocalVerifier:
    """A LocalVerifier that runs the rounds it is allowed on its own, as the target service does
    (services/target/servicer.py), with its own suffix drafter over the session's tokens."""

    def __init__(self, target: ModelRunner, sampling: SamplingParams = GREEDY) -> None:
        self.local = LocalVerifier(target, CAPACITY, sampling=sampling)
        self.drafter = suffix_drafter(None, MAX_NODES, GREEDY, lambda: NOMINAL_CPU_COST)
        self.ahead_limit = MAX_AHEAD_ROUNDS if sampling.greedy else 0
        self.plans: list[AheadPlan] = []
        self.account: SuffixTrust | None = None

    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        return self.local.prefill(prompt_ids, round_seed)

    def resume(self, token_ids: Sequence[int]) -> None:
        self.local.resume(token_ids)

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        return self.local.verify(draft, round_seed)

    def verify_ahead(
        self, draft: DraftTree, round_seed: int, plan: AheadPlan, max_tokens: int
    ) -> list[Round]:
        self.plans.append(plan)
        first = (draft, self.local.verify(draft, round_seed))
        rounds = run_ahead(
            first,
            lambda: self.local.token_ids,
            self.drafter,
            lambda d: self.local.verify(d, 0),
            plan,
            max_tokens,
            frozenset(),
            lambda: self.drafter.expected_suffix_tokens,
        )
        self.account = None if plan.suffix is None else self.drafter.suffix_trust().observed()
        return rounds

    def take_suffix_trust(self) -> SuffixTrust | None:
        taken, self.account = self.account, None
        return taken

    def release(self) -> None:
        self.local.release()


def reference(target: ModelRunner, max_new_tokens: int = 48) -> list[int]:
    finish = FinishChecker(max_new_tokens, frozenset())
    speculative_generate(PROMPT, LocalVerifier(target, CAPACITY, sampling=GREEDY), None, 0, finish)
    return finish.generated


@pytest.mark.parametrize("max_new_tokens", [48, 5])
def test_rounds_run_ahead_leave_the_greedy_output_the_targets(target, max_new_tokens):
    verifier = AheadLocalVerifier(target)
    drafter = suffix_drafter(None, MAX_NODES, GREEDY, lambda: NOMINAL_CPU_COST)
    finish = FinishChecker(max_new_tokens, frozenset())
    stats = speculative_generate(PROMPT, verifier, drafter, 0, finish)
    assert finish.generated == reference(target, max_new_tokens)
    # No model: every round may run ahead (those the loop skips its drafter for, or all eight)
    assert stats.num_ahead_rounds > 0 and verifier.plans
    assert all(plan.rounds >= 1 and plan.copy_rounds == 0 for plan in verifier.plans)
    assert stats.num_generated_tokens == max_new_tokens  # the last call's extra tokens are not emitted
    # each call's rounds after its first are the loop's rounds too, and the drafter saw every one
    assert stats.num_target_forwards > len(verifier.plans) + 1


def test_a_sampled_session_runs_no_round_ahead(target):
    params = SamplingParams(temperature=0.8)
    verifier = AheadLocalVerifier(target, params)
    drafter = suffix_drafter(None, MAX_NODES, params, lambda: NOMINAL_CPU_COST)
    stats = speculative_generate(PROMPT, verifier, drafter, 7, FinishChecker(24, frozenset()))
    assert stats.num_ahead_rounds == 0 and verifier.plans == []


def first_round(verifier: LocalVerifier) -> Round:
    draft = DraftTree.root_only(verifier.token_ids[-1])
    return draft, verifier.verify(draft, 0)


def ahead(target: ModelRunner, plan: AheadPlan, max_tokens: int = 100, **kwargs) -> list[Round]:
    local = LocalVerifier(target, CAPACITY, sampling=GREEDY)
    local.prefill(PROMPT, 0)
    drafter = kwargs.pop("drafter", SuffixDrafter(None, MAX_NODES, NOMINAL_CPU_COST))
    stop = kwargs.pop("stop_token_ids", frozenset())
    return run_ahead(
        first_round(local),
        lambda: local.token_ids,
        drafter,
        lambda d: local.verify(d, 0),
        plan,
        max_tokens,
        stop,
        **kwargs,
    )


def tokens_of(rounds: list[Round]) -> list[int]:
    return [t for round_ in rounds for t in committed_tokens(*round_)]


def test_rounds_ahead_commit_what_plain_decoding_does_and_stop_at_the_budget(target):
    expected = reference(target)
    rounds = ahead(target, AheadPlan(6))
    assert len(rounds) == 7
    made = tokens_of(rounds)
    assert made == expected[1 : 1 + len(made)]  # the prefill emitted expected[0]
    assert 3 <= len(tokens_of(ahead(target, AheadPlan(6), max_tokens=3))) < 3 + MAX_NODES
    assert len(ahead(target, AheadPlan(6), max_tokens=1)) == 1  # the first round used the budget


def test_rounds_ahead_stop_after_an_end_of_sequence_token(target):
    expected = reference(target)
    stop = expected[4]
    rounds = ahead(target, AheadPlan(8), stop_token_ids=frozenset({stop}))
    made = tokens_of(rounds)
    assert stop in made and stop not in tokens_of(rounds[:-1])


def test_rounds_ahead_stop_where_the_kv_has_no_room(target):
    assert len(ahead(target, AheadPlan(8), admit=lambda draft: False)) == 1
    admitted: list[DraftTree] = []
    rounds = ahead(target, AheadPlan(8), admit=lambda d: admitted.append(d) or len(admitted) <= 2)
    assert len(rounds) == 3


class ExpectingDrafter(SuffixDrafter):
    """A one-token guess every round (never nothing, so no round is skipped) whose expectation is
    scripted: what a round's proposal claims it will add."""

    def __init__(self, expectations: Sequence[float]) -> None:
        super().__init__(None, MAX_NODES, NOMINAL_CPU_COST)
        self.expectations, self.observed = list(expectations), 0

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self.current = self.expectations.pop(0)
        return DraftTree(TokenTree.chain([token_ids[-1], 1]), suffix_nodes=frozenset({1}))

    @property
    def expected_suffix_tokens(self) -> float:
        return self.current

    def observe(self, outcome) -> None:
        self.observed += 1
        super().observe(outcome)


def test_copy_rounds_go_on_only_while_the_suffix_expects_enough(target):
    drafter = ExpectingDrafter([0.0, 0.0, 3.0, 2.0, 0.5, 5.0])
    plan = AheadPlan(2, 6, copy_tokens=1.0)
    rounds = ahead(target, plan, drafter=drafter, expected_tokens=lambda: drafter.expected_suffix_tokens)
    # two certain rounds (whatever they expect), two copy rounds, then one that falls short: unverified
    assert len(rounds) == 5 and drafter.observed == 4


class EmptyDrafter(SuffixDrafter):
    """Proposes nothing (the root alone), and records each round it is asked for, by committed length."""

    def __init__(self) -> None:
        super().__init__(None, MAX_NODES, NOMINAL_CPU_COST)
        self.asked_at: list[int] = []

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self.asked_at.append(len(token_ids))
        return DraftTree.root_only(token_ids[-1])


def test_rounds_the_loop_would_skip_verify_the_root_alone_and_ask_no_drafter(target):
    drafter = EmptyDrafter()
    rounds = ahead(target, AheadPlan(8, skip_run=2, skip_left=2), drafter=drafter)
    assert len(rounds) == 9 and all(draft.tree.num_nodes == 1 for draft, _ in rounds)
    # two rounds left of a run of two, then asked (nothing: a run of four), then asked again
    assert len(drafter.asked_at) == 2
    first_length = len(PROMPT) + 2  # the prefill's token and the first round's
    assert drafter.asked_at == [first_length + 2, first_length + 2 + 1 + 4]


def sized_by_count() -> SuffixDrafter:
    """Suffix candidates sized by their count alone (no cost, so not by trust either): two of them
    over the same tokens propose the same trees, whichever rounds each has seen."""
    return SuffixDrafter(None, MAX_NODES, None, worth_book=WorthBook(WorthPriors(), "session"))


class RecordingVerifier(LocalVerifier):
    def __init__(self, target: ModelRunner) -> None:
        super().__init__(target, CAPACITY, sampling=GREEDY)
        self.trees: list[list[int]] = []

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        self.trees.append(list(draft.tree.token_ids))
        return super().verify(draft, round_seed)


class RecordingAheadVerifier(AheadLocalVerifier):
    def __init__(self, target: ModelRunner) -> None:
        super().__init__(target)
        self.local = RecordingVerifier(target)
        self.drafter = sized_by_count()


def test_rounds_ahead_are_the_rounds_the_loop_runs_in_process(target):
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6]  # repeats: some rounds find candidates, some not
    alone = RecordingVerifier(target)
    speculative_generate(prompt, alone, sized_by_count(), 0, FinishChecker(40, frozenset()))
    beside = RecordingAheadVerifier(target)
    stats = speculative_generate(prompt, beside, sized_by_count(), 0, FinishChecker(40, frozenset()))
    assert stats.num_ahead_rounds > 0
    assert beside.local.trees[: len(alone.trees)] == alone.trees  # tree by tree, root alone or drafted
    assert any(len(tree) == 1 for tree in alone.trees) and any(len(tree) > 1 for tree in alone.trees)


# A verify curve as steep as a CPU's (verify(8) 2.2 one-token steps): a candidate is kept only where its
# score, discounted by trust, pays for its row, so trust sizes the trees.
STEEP_COST = CostModel(((1, 1.0), (2, 1.12), (4, 1.4), (8, 2.2), (16, 4.0)), draft_step_s=0.0)


def trust_sized() -> SuffixDrafter:
    return suffix_drafter(None, MAX_NODES, GREEDY, lambda: STEEP_COST)


def test_rounds_ahead_are_sized_by_the_loops_own_suffix_account(target):
    """Candidates sized by trust on a cost curve: the verifier's drafter continues from the loop's
    account and hands its own back, so every tree is the one the loop's drafter alone would send."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    alone, alone_drafter = RecordingVerifier(target), trust_sized()
    speculative_generate(prompt, alone, alone_drafter, 0, FinishChecker(64, frozenset()))
    beside, beside_drafter = RecordingAheadVerifier(target), trust_sized()
    beside.drafter = trust_sized()  # on the same curve as the loop's
    stats = speculative_generate(prompt, beside, beside_drafter, 0, FinishChecker(64, frozenset()))
    assert stats.num_ahead_rounds > 0
    assert beside.local.trees[: len(alone.trees)] == alone.trees
    assert {len(tree) for tree in alone.trees} > {1, 2}  # candidates sized variously, not all or none
    assert beside_drafter.trust == pytest.approx(alone_drafter.trust)
    assert alone_drafter.trust != SuffixDrafter(None, MAX_NODES).trust  # it learnt something


def test_no_round_ahead_starts_after_the_deadline(target):
    ticks = iter(range(100))
    rounds = ahead(target, AheadPlan(8), deadline=3.0, clock=lambda: float(next(ticks)))
    assert len(rounds) == 4  # rounds started at clock 0, 1 and 2; none at 3


class CertainDrafter(SuffixDrafter):
    """Always proposes (so the loop never skips it) and plans three certain rounds and two copy rounds;
    records the rounds it is told ran elsewhere."""

    def __init__(self) -> None:
        super().__init__(None, MAX_NODES, NOMINAL_CPU_COST)
        self.skipped: list[int] = []

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        return DraftTree(TokenTree.chain([token_ids[-1], 1]), suffix_nodes=frozenset({1}))

    def rounds_without_model(self, limit: int) -> AheadPlan:
        return AheadPlan(3, 2, 0.0)

    def skip_rounds(self, count: int) -> None:
        self.skipped.append(count)


class OneRoundAhead(AheadLocalVerifier):
    """Runs at most one round on its own per call, whatever the plan allows (as a deadline would)."""

    def __init__(self, target: ModelRunner) -> None:
        super().__init__(target)
        self.drafter = CertainDrafter()  # proposes every round here too: no round is skipped
        self.asked: list[AheadPlan] = []

    def verify_ahead(self, draft, round_seed, plan, max_tokens):
        self.asked.append(plan)
        one = replace(plan, rounds=min(plan.rounds, 1), copy_rounds=0)
        return super().verify_ahead(draft, round_seed, one, max_tokens)


def test_only_the_rounds_that_ran_count_as_skipped(target):
    drafter = CertainDrafter()
    verifier = OneRoundAhead(target)
    stats = speculative_generate(PROMPT, verifier, drafter, 0, FinishChecker(24, frozenset()))
    assert verifier.asked and all(
        replace(plan, suffix=None) == AheadPlan(3, 2, 0.0) for plan in verifier.asked
    )
    assert set(drafter.skipped) <= {0, 1} and sum(drafter.skipped) == stats.num_ahead_rounds > 0
