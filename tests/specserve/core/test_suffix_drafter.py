"""Suffix candidates merged with a model draft: no model call on suffix-only rounds, merged trees within
budget, sampled trees never mixed, trust that follows acceptance. (Exactness and the target's
distribution with a real model: tests/specserve/runtime/test_suffix_drafting.py.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from specserve.core.backoff import MAX_SKIPPED_ROUNDS
from specserve.core.cost import CostModel
from specserve.core.prompt_indexes import PromptIndexCache, TenantPrompts
from specserve.core.protocols import (
    READS_NOTHING,
    AheadPlan,
    CandidateKind,
    Drafter,
    DraftTree,
    RoundOutcome,
    SuffixTrust,
)
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.suffix import SharedSuffixCache
from specserve.core.suffix_drafter import (
    ModelWorth,
    SuffixDrafter,
    SuffixSettings,
    TenantCache,
    WorthBook,
    WorthPriors,
    suffix_drafter,
)
from specserve.core.tree import TokenTree, tree_children
from specserve.errors import InvalidArgument

FLAT_COST = CostModel(((1, 1.0), (8, 1.1), (16, 1.3), (64, 3.0)), draft_step_s=0.05)


class CountingDrafter:
    """A model drafter stand-in that proposes one fixed chain and counts how often it was asked."""

    reads = READS_NOTHING

    def __init__(self, chain: Sequence[int] = (), kind: CandidateKind = CandidateKind.FIXED) -> None:
        self.chain, self.kind, self.calls = list(chain), kind, 0

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self.calls += 1
        return DraftTree(TokenTree.chain([token_ids[-1], *self.chain]), self.kind)

    def observe(self, outcome) -> None:
        pass

    def release(self) -> None:
        pass


def test_a_confident_suffix_round_does_not_ask_the_model():
    model = CountingDrafter([99])
    drafter = SuffixDrafter(model, 16, FLAT_COST, SuffixSettings(model_skip_tokens=1.0))
    text = [7, 8, 9, 10, 11] * 6 + [7, 8]
    draft = drafter.propose(text, round_seed=0, batch_sessions=1)
    assert model.calls == 0 and drafter.num_suffix_only_rounds == 1
    assert draft.tree.token_ids[:4] == (8, 9, 10, 11) and draft.suffix_nodes
    # text never seen before: the model is asked, and its chain is the tree
    fresh = drafter.propose([*text, 50, 51, 52], round_seed=1, batch_sessions=1)
    assert model.calls == 1 and fresh.tree.token_ids == (52, 99) and not fresh.suffix_nodes


def test_merged_trees_have_no_duplicate_paths_and_respect_the_node_budget():
    text = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]  # after "1 2": 3 4 / 5 6 / 3 7
    for budget in (4, 5, 8, 16):  # the model tree (4 nodes) fits; suffix nodes fill the rest
        model = CountingDrafter([3, 4, 9])  # shares "3 4" with a suffix branch
        drafter = SuffixDrafter(model, budget, None, SuffixSettings(min_score=0.0, model_skip_tokens=100.0))
        draft = drafter.propose(text, round_seed=0, batch_sessions=1)
        tree = draft.tree
        assert tree.num_nodes <= budget and tree.token_ids[0] == 2
        for kids in tree_children(tree.parent_ids):
            tokens = [tree.token_ids[c] for c in kids]
            assert len(tokens) == len(set(tokens))  # one node per path
        assert draft.kind is CandidateKind.FIXED
        assert all(0 < node < tree.num_nodes for node in draft.suffix_nodes)
    # with room, every model node and every suffix branch is there
    assert set(zip(tree.parent_ids, tree.token_ids, strict=True)) >= {(-1, 2), (0, 3), (0, 5), (1, 4)}


def test_sampled_model_trees_are_never_mixed_with_suffix_candidates():
    model = CountingDrafter([3, 4], kind=CandidateKind.SAMPLED)
    drafter = SuffixDrafter(model, 16, None, SuffixSettings(min_score=0.0, model_skip_tokens=100.0))
    draft = drafter.propose([1, 2, 5, 6, 1, 2], round_seed=0, batch_sessions=1)
    assert (
        draft.kind is CandidateKind.SAMPLED and draft.tree.token_ids == (2, 3, 4) and not draft.suffix_nodes
    )


def test_trust_falls_when_suffix_candidates_are_rejected_and_sizes_fall_with_it():
    drafter = SuffixDrafter(None, 16, FLAT_COST)
    text = [1, 2, 3, 4, 5, 6] * 4
    first = draft = drafter.propose(text, 0, 1)
    start = drafter.trust
    for round_ in range(8):  # the target writes something else after the root, then the pattern again
        drafter.observe(RoundOutcome.from_committed(draft, [60 + round_]))  # every candidate rejected
        text = [*text, 60 + round_, 1, 2, 3, 4, 5, 6]
        draft = drafter.propose(text, round_ + 1, 1)
    assert drafter.trust < start / 2
    assert first.tree.num_nodes > 1


# Cheap up to 8 nodes, then steep: where a batch's forward lands decides what a node costs.
KNEE_COST = CostModel(((1, 1.0), (8, 1.1), (12, 2.0), (64, 9.0)), draft_step_s=0.05)
REPEATING = [7, 8, 9, 10, 11] * 6 + [7, 8]  # the suffix index is sure of what follows "7 8"


def test_in_a_batch_the_other_sessions_are_taken_to_send_trees_like_this_one():
    # Beside 3 others taken as the root alone (3 nodes), 4 candidates fit under the knee; if the others
    # send trees like this session's recent ones (2 nodes each), the forward is at the knee and one
    # candidate pays. Taken for the root alone, the others' nodes were never priced.
    drafter = SuffixDrafter(None, 32, KNEE_COST)
    drafter._sync(REPEATING)
    proposal = drafter._suffix_proposal(REPEATING)
    assert proposal is not None
    assert drafter._sized(proposal, 1, batch_sessions=4) == 4
    drafter.mean_nodes, drafter.mean_emitted = 2.0, 2.0
    assert drafter._sized(proposal, 1, batch_sessions=4) == 1
    assert drafter._sized(proposal, 1, batch_sessions=1) == 7  # alone: the means do not matter
    assert SuffixDrafter(None, 32, KNEE_COST)._sized(proposal, 1, batch_sessions=1) == 7


def test_the_round_sizes_follow_the_rounds_the_target_verified():
    drafter = SuffixDrafter(None, 32, KNEE_COST)
    draft = drafter.propose(REPEATING, round_seed=0, batch_sessions=1)
    assert draft.tree.token_ids[:3] == (8, 9, 10) and draft.tree.num_nodes >= 3
    # the target accepted "9" and then chose 42 (not "10"): 1 drafted token on the path, 2 emitted
    drafter.observe(RoundOutcome.from_committed(draft, [9, 42]))
    assert drafter.mean_nodes == pytest.approx(0.8 * 1.0 + 0.2 * draft.tree.num_nodes)
    assert drafter.mean_emitted == pytest.approx(0.8 * 1.0 + 0.2 * 2)


# --- assembly: the one function the engine and the router build a session's drafter with ---------------


def test_a_greedy_session_is_sized_by_the_cost_it_is_given_and_shares_the_batch():
    asked: list[int] = []

    def calibrated() -> CostModel:
        asked.append(1)
        return FLAT_COST

    shared = TenantCache(SharedSuffixCache(4, 64), "tenant")
    model = CountingDrafter([99])
    drafter = suffix_drafter(model, 16, GREEDY, calibrated, shared=shared)
    assert drafter.inner is model and drafter.max_tree_nodes == 16
    assert drafter.cost is FLAT_COST and asked == [1]
    assert drafter.batch_aware and drafter.shared is shared


def test_a_sampled_session_is_sized_by_its_targets_costs_as_if_alone_and_from_its_own_text():
    """Its tree decides its random draws: the serving target's curve (in process this machine's), as if
    alone, no other session's outputs. Where a node costs more, fewer are drafted: on the nominal curve a
    host whose verify(8) is 2 steps drafted at a loss."""
    shared = TenantCache(SharedSuffixCache(4, 64), "tenant")
    sampled = SamplingParams(temperature=0.7)
    drafter = suffix_drafter(None, 16, sampled, lambda: FLAT_COST, shared=shared)
    assert drafter.inner is None and drafter.cost is FLAT_COST and drafter.shared is None
    crowded = drafter.propose(REPEATING, round_seed=0, batch_sessions=64)
    alone = suffix_drafter(None, 16, sampled, lambda: FLAT_COST).propose(REPEATING, 0, batch_sessions=1)
    assert crowded.tree == alone.tree and crowded.num_draft_tokens > 0
    steep = CostModel(((1, 1.0), (4, 1.05), (8, 4.0), (16, 8.0)), draft_step_s=0.05)  # dear beyond 4 rows
    dear = suffix_drafter(None, 16, sampled, lambda: steep).propose(REPEATING, 0, batch_sessions=1)
    assert 0 < dear.num_draft_tokens < alone.num_draft_tokens


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7)])
def test_a_session_from_its_tenants_earlier_prompt_drafts_the_same_trees(sampling):
    """The prompt index cache changes what is indexed, never what is proposed: greedy and sampled
    sessions alike (a sampled session's tree decides its draws)."""
    prompts = TenantPrompts(PromptIndexCache(4096, block_tokens=8), "tenant")
    document = [7, 8, 9, 10, 11, 12, 13, 7, 8, 9, 20, 21] * 4
    suffix_drafter(None, 16, sampling, lambda: FLAT_COST, prompts=prompts).propose(
        [*document, 1, 2], round_seed=0, batch_sessions=1
    )
    cached = suffix_drafter(None, 16, sampling, lambda: FLAT_COST, prompts=prompts)
    alone = suffix_drafter(None, 16, sampling, lambda: FLAT_COST)
    text = [*document, 3, 7, 8]
    for round_seed in range(6):
        ours, theirs = (d.propose(text, round_seed, batch_sessions=1) for d in (cached, alone))
        assert ours.tree == theirs.tree and ours.suffix_nodes == theirs.suffix_nodes
        text += list(ours.tree.token_ids[1:3]) or [5]
    assert cached.index.shared_tokens == len(document) // 8 * 8 and alone.index.shared_tokens == 0


class NoGrammar:
    """A constraint the model drafter never reads (CountingDrafter does not mask its drafts)."""

    max_tree_nodes = 64


NO_GRAMMAR: Any = NoGrammar()


def test_model_worth_pays_while_its_tokens_outlast_its_call_and_explores_at_doubling_gaps():
    assert ModelWorth(token_s=0.006).pays()  # no call timed yet: it is asked
    worth = ModelWorth(gain=2.0, call_s=0.010, token_s=0.006)
    assert worth.pays()  # 2 tokens x 6 ms >= 10 ms
    worth.token_s = 0.004
    assert not worth.pays()
    asked = []
    for _ in range(16):
        asked.append(worth.should_ask())
        if asked[-1]:
            worth.observe(0)  # it adds nothing: its gaps double, up to DraftBackoff's cap
    assert asked == [True, False, True, False, False, True] + [False] * 4 + [True] + [False] * 5
    worth.gain, worth.call_s = 5.0, 0.001
    worth.observe(5)
    assert worth.pays() and all(worth.should_ask() for _ in range(4))


class Clock:
    """The seconds a test says passed: what a session's account times is what the test means it to, on a
    loaded machine too."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowDrafter(CountingDrafter):
    def __init__(self, chain: Sequence[int], seconds: float, clock: Clock) -> None:
        super().__init__(chain)
        self.seconds = seconds
        self.clock = clock

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self.clock.now += self.seconds
        return super().propose(token_ids, round_seed, batch_sessions)


def _rounds(drafter: SuffixDrafter, accepted: int, round_s: float, clock: Clock, rounds: int = 12) -> None:
    """Rounds over text the suffix index never saw, each accepting `accepted` drafted tokens and taking
    `round_s` on `clock` to verify."""
    text = list(range(1000, 1010))
    for i in range(rounds):
        draft = drafter.propose(text, round_seed=i, batch_sessions=1)
        kept = min(accepted, draft.tree.num_nodes - 1)
        clock.now += round_s
        drafter.observe(RoundOutcome(draft, tuple(range(kept + 1)), 5000 + i))
        text += [*draft.tree.token_ids[1 : 1 + kept], 5000 + i]


def _session(inner: Drafter, clock: Clock, book: WorthBook | None = None) -> SuffixDrafter:
    """A greedy session's drafter whose account of its model reads `clock` (its own unless `book`)."""
    book = book or WorthBook(WorthPriors(clock), "session")
    return suffix_drafter(inner, 16, GREEDY, lambda: FLAT_COST, worth=book)


def test_a_greedy_session_asks_its_model_less_where_its_drafts_cost_more_than_they_add():
    clock = Clock()
    costly = SlowDrafter([99, 98], seconds=0.02, clock=clock)  # 20 ms a call, nothing accepted, 2 ms rounds
    drafter = _session(costly, clock)
    _rounds(drafter, accepted=0, round_s=0.002, clock=clock)
    assert drafter.model_worth is not None and not drafter.model_worth.pays()
    assert costly.calls <= 6 and drafter.num_suffix_only_rounds >= 6
    useful = SlowDrafter([99, 98], seconds=0.0, clock=clock)  # free, both tokens accepted
    drafter = _session(useful, clock)
    _rounds(drafter, accepted=2, round_s=0.002, clock=clock)
    assert useful.calls == 12 and drafter.num_suffix_only_rounds == 0


def test_a_sampled_session_asks_its_model_whatever_it_costs():
    """A sampled tree decides its random draws: it must not depend on how long anything took."""
    clock = Clock()
    costly = SlowDrafter([99, 98], seconds=0.005, clock=clock)
    drafter = suffix_drafter(costly, 16, SamplingParams(temperature=0.7), lambda: FLAT_COST)
    _rounds(drafter, accepted=0, round_s=0.0, clock=clock, rounds=6)
    assert drafter.model_worth is None and costly.calls == 6


def test_a_session_starts_from_what_the_model_earned_in_the_sessions_before_of_its_kind():
    clock = Clock()
    priors = WorthPriors(clock)
    book = WorthBook(priors, "eagle")
    first = SlowDrafter([99, 98], seconds=0.02, clock=clock)
    _rounds(_session(first, clock, book), accepted=0, round_s=0.002, clock=clock)
    assert first.calls >= 1 and "eagle" in priors._known
    # The next session of the kind asks the model first after DraftBackoff's longest gap, not at once.
    second = SlowDrafter([99, 98], seconds=0.02, clock=clock)
    drafter = _session(second, clock, book)
    _rounds(drafter, accepted=0, round_s=0.002, clock=clock, rounds=MAX_SKIPPED_ROUNDS)
    assert second.calls == 0
    _rounds(drafter, accepted=0, round_s=0.002, clock=clock, rounds=1)
    assert second.calls == 1
    # A constrained session is another kind: nothing known yet, so its model is asked on its first round.
    third = SlowDrafter([99, 98], seconds=0.0, clock=clock)
    drafter = _session(third, clock, book)
    drafter.constrain(NO_GRAMMAR)
    _rounds(drafter, accepted=2, round_s=0.002, clock=clock, rounds=2)
    assert third.calls == 2 and "eagle:constrained" in priors._known


def test_a_session_where_the_model_paid_starts_asking_it():
    clock = Clock()
    book = WorthBook(WorthPriors(clock), "eagle")
    _rounds(_session(SlowDrafter([99, 98], 0.0, clock), clock, book), 2, 0.002, clock)
    useful = SlowDrafter([99, 98], seconds=0.0, clock=clock)
    _rounds(_session(useful, clock, book), accepted=2, round_s=0.002, clock=clock)
    assert useful.calls == 12


def test_the_rounds_without_a_model_are_planned_ahead_only_for_a_greedy_session():
    """What a verifier may run on its own after a round (core/ahead.py): every round without a model;
    with one, the rounds its account skips anyway, then rounds while the suffix alone expects what
    `propose` skips the model at; nothing for a sampled session. Those that ran use the skipped up."""
    assert suffix_drafter(None, 16, GREEDY, lambda: FLAT_COST).rounds_without_model(8) == AheadPlan(8)
    sampled = suffix_drafter(None, 16, SamplingParams(temperature=0.7), lambda: FLAT_COST)
    assert sampled.rounds_without_model(8) == AheadPlan(0)

    clock = Clock()
    paying = _session(SlowDrafter([99, 98], 0.0, clock), clock)
    _rounds(paying, accepted=2, round_s=0.002, clock=clock)
    skip = SuffixSettings().model_skip_tokens
    assert paying.rounds_without_model(8) == AheadPlan(0, 8, skip)  # asked on every round

    costly = _session(SlowDrafter([99, 98], 0.02, clock), clock)
    _rounds(costly, accepted=0, round_s=0.002, clock=clock)
    worth = costly.model_worth
    assert worth is not None and not worth.pays()
    worth.explore.left = 5
    assert costly.rounds_without_model(8) == AheadPlan(5, 3, skip)
    assert costly.rounds_without_model(3) == AheadPlan(3, 0, skip) and worth.explore.left == 5
    costly.skip_rounds(5)
    assert worth.explore.left == 0 and worth.should_ask()  # the rounds that ran were its skipped ones
    worth.explore.left = 12
    costly.skip_rounds(8)
    assert costly.rounds_without_model(8) == AheadPlan(4, 4, skip)


def test_the_suffix_expectation_is_the_last_proposal_s_score_times_trust():
    drafter = SuffixDrafter(None, 16, FLAT_COST)
    assert drafter.expected_suffix_tokens == 0.0
    draft = drafter.propose(REPEATING, round_seed=0, batch_sessions=1)
    assert draft.suffix_nodes and drafter.expected_suffix_tokens > 1.0
    assert drafter.expected_suffix_tokens == pytest.approx(drafter._predicted * drafter.trust)
    drafter.propose(list(range(500, 520)), round_seed=1, batch_sessions=1)  # nothing seen before
    assert drafter.expected_suffix_tokens == 0.0


@pytest.mark.parametrize("trust", [0.0, 0.04, 1.6, math.nan])
def test_an_initial_trust_outside_the_range_an_account_travels_in_is_refused(trust):
    with pytest.raises(InvalidArgument, match="initial_trust"):
        SuffixSettings(initial_trust=trust)
    SuffixSettings(initial_trust=SuffixTrust.MIN_TRUST)  # the bounds themselves are fine
    SuffixSettings(initial_trust=SuffixTrust.MAX_TRUST)
