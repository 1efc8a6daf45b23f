"""Stop policies inside both drafters: where the spine ends, the feedback they get, lossless output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from specserve.core.cape import CapeSettings
from specserve.core.cost import CostModel
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind, DraftTree, RoundOutcome, VerifyOutcome
from specserve.core.sampling_params import SamplingParams
from specserve.core.stopping import (
    STOP_POLICIES,
    DraftStep,
    RoundPolicy,
    StopPolicy,
    StopPolicyName,
    StopSettings,
)
from specserve.core.tree import TokenTree, tree_children
from specserve.errors import InvalidArgument
from specserve.glide import GlideDraft, GlideDrafter, build_glide
from specserve.runtime.drafter import (
    DraftShape,
    ModelDrafter,
    SpineFeedback,
    grow_spine_tree,
    spine_cap,
    spine_token_ids,
)
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256
V = 64  # tiny_llama's vocabulary
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)
NEVER_STOPS = StopSettings(svip_h=1e9)  # sqrt(c H) never exceeds it
ALWAYS_STOPS = StopSettings(svip_h=0.0)  # any entropy above 0 exceeds it

# A flat verify curve and a draft step of no cost: every token with any chance of acceptance pays.
FREE_DRAFT = CostModel(((1, 1.0), (64, 1.0)), draft_step_s=0.0)


# --- small fakes ------------------------------------------------------------------------------------


class RecordingPolicy:
    """Wraps a policy; keeps every step it was asked about and every round it observed."""

    def __init__(self, inner: StopPolicy) -> None:
        self.inner = inner
        self.steps: list[DraftStep] = []
        self.observed: list[tuple[int, int]] = []
        self.calls: list[str] = []  # "observe" and "start", in order

    @property
    def max_depth(self) -> int:
        return self.inner.max_depth

    def start_round(self, batch_sessions: int) -> int:
        self.calls.append("start")
        if isinstance(self.inner, RoundPolicy):
            return self.inner.start_round(batch_sessions)
        return self.inner.max_depth

    def should_stop(self, step: DraftStep) -> bool:
        self.steps.append(step)
        return self.inner.should_stop(step)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.observed.append((num_drafted, num_accepted))
        self.calls.append("observe")
        self.inner.observe(num_drafted, num_accepted)


class StopAt:
    """Stops after the spine token at `depth_index`; cap `max_depth`."""

    def __init__(self, depth_index: int, max_depth: int = 40) -> None:
        self.depth_index, self.max_depth = depth_index, max_depth

    def should_stop(self, step: DraftStep) -> bool:
        return step.depth_index == self.depth_index

    def observe(self, num_drafted: int, num_accepted: int) -> None: ...


class RecordingVerifier:
    """Wraps a LocalVerifier; keeps every (draft, outcome), the ground truth of each round."""

    def __init__(self, inner: LocalVerifier) -> None:
        self.inner = inner
        self.rounds: list[tuple[DraftTree, VerifyOutcome]] = []

    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        return self.inner.prefill(prompt_ids, round_seed)

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        outcome = self.inner.verify(draft, round_seed)
        self.rounds.append((draft, outcome))
        return outcome

    def release(self) -> None:
        self.inner.release()


def spine_nodes(tree: TokenTree) -> list[int]:
    children, spine = tree_children(tree.parent_ids), [0]
    while children[spine[-1]]:
        spine.append(children[spine[-1]][0])
    return spine[1:]


def true_round(draft: DraftTree, outcome: VerifyOutcome) -> tuple[int, int]:
    """(spine tokens drafted, spine tokens accepted) as the verifier decided them."""
    spine, accepted = spine_nodes(draft.tree), 0
    for node, spine_node in zip(outcome.accepted_nodes[1:], spine, strict=False):
        if node != spine_node:
            break
        accepted += 1
    return len(spine), accepted


# --- models -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glide(target: ModelRunner) -> GlideDraft:
    model = build_glide(target.model, seed=0)
    model.init_weights(torch.Generator().manual_seed(0), std=0.3)
    return model


def run(target, make_drafter, params=GREEDY, seed=0):
    """make_drafter(verifier, sampling) -> drafter or None; returns (generated, verifier, drafter)."""
    verifier = RecordingVerifier(LocalVerifier(target, CAPACITY, sampling=params))
    drafter = make_drafter(verifier.inner, params)
    finish = FinishChecker(40, frozenset())
    speculative_generate(PROMPT, verifier, drafter, seed, finish)
    return finish.generated, verifier, drafter


def model_drafter(runner: ModelRunner, shape: DraftShape):
    return lambda verifier, sampling: ModelDrafter(runner, CAPACITY, shape, sampling)


def glide_drafter(model: GlideDraft, shape: DraftShape, cape: CapeSettings | None = None):
    return lambda verifier, sampling: GlideDrafter(model, verifier.cache, CAPACITY, shape, cape, sampling)


# --- grow_spine_tree with a policy, on hand-built logits --------------------------------------------


def scripted_logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))  # [V]


def grow(depth: int, widths: tuple[int, ...], stop: StopPolicy | None):
    """grow_spine_tree on scripted logits; returns the tree, the logits of each depth, the advance calls."""
    logits_per_depth = [scripted_logits(0)]
    advanced: list[tuple[int, int]] = []

    def advance(spine_token: int, depth_index: int) -> torch.Tensor:
        advanced.append((spine_token, depth_index))
        logits_per_depth.append(scripted_logits(1000 * (depth_index + 1) + spine_token))
        return logits_per_depth[-1]

    shape = DraftShape(depth=depth, widths=widths)
    width_at = lambda d, _logits, _n: shape.width(d)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    draft = grow_spine_tree(
        1, logits_per_depth[0], depth, width_at, advance, GREEDY, CandidateKind.FIXED, generator, stop
    )
    return draft, logits_per_depth, advanced


@pytest.mark.parametrize("depth,widths", [(0, ()), (1, ()), (4, ()), (4, (3, 2)), (6, (2,) * 6)])
def test_fixed_policy_grows_the_policy_free_tree(depth, widths):
    free, _, free_advanced = grow(depth, widths, None)
    policy = DraftShape(depth=depth, widths=widths).new_stop_policy()
    fixed, _, fixed_advanced = grow(depth, widths, policy)
    assert fixed.tree == free.tree and fixed_advanced == free_advanced
    assert len(spine_token_ids(fixed.tree)) == depth


def test_a_stop_keeps_the_token_and_its_leaves_and_runs_no_further_forward():
    policy = RecordingPolicy(StopAt(depth_index=1))
    draft, logits_per_depth, advanced = grow(5, (3, 2, 2), policy)
    assert [d for _, d in advanced] == [0]  # none on the token that stopped the round
    assert len(spine_token_ids(draft.tree)) == 2
    assert draft.tree.depths().count(2) == 2  # depth 2 (index 1) kept its leaf
    assert [step.depth_index for step in policy.steps] == [0, 1]
    for step, logits, token in zip(policy.steps, logits_per_depth, spine_token_ids(draft.tree), strict=True):
        assert step.logits is logits and step.token == token  # the raw logits the candidates came from


def test_the_last_token_at_the_cap_is_asked_about_too():
    policy = RecordingPolicy(StopAt(depth_index=-1, max_depth=3))  # never stops; caps at 3
    draft, _, advanced = grow(5, (), policy)
    assert len(spine_token_ids(draft.tree)) == 3 == len(policy.steps)  # min(depth 5, cap 3)
    assert len(advanced) == 2


def test_draft_shape_validates_the_policy_and_sets_the_fixed_depth():
    with pytest.raises(InvalidArgument):
        DraftShape(stop="no-such-policy")  # type: ignore[arg-type]
    assert DraftShape(depth=6, stop_settings=StopSettings(fixed_depth=2)).new_stop_policy().max_depth == 6
    assert spine_cap(0, DraftShape(depth=0).new_stop_policy()) == 0  # StopSettings needs fixed_depth >= 1
    svip = DraftShape(depth=6, stop=StopPolicyName.SVIP, stop_settings=StopSettings(max_depth=3))
    assert svip.new_stop_policy().max_depth == 3


# --- SpineFeedback: each round's result from its outcome --------------------------------------------

ROOT, SPINE = 7, [10, 11, 12]
LEAFY = DraftTree(TokenTree((ROOT, 10, 20, 11, 21, 12), (-1, 0, 0, 1, 1, 3)))  # spine 10 11 12, 2 leaves


@pytest.mark.parametrize(
    "new_tokens,expected",
    [
        ([10, 11, 12, 30], [(3, 3)]),  # all accepted, then the bonus
        ([10, 11, 31], [(3, 2)]),
        ([31], [(3, 0)]),  # the first spine token rejected
        ([20, 31], [(3, 0)]),  # the leaf at depth 1 taken: no spine token accepted
        ([10, 21, 31], [(3, 1)]),
    ],
)
def test_feedback_counts_the_accepted_spine_prefix(new_tokens, expected):
    policy, feedback = RecordingPolicy(StopAt(-1)), SpineFeedback()
    token_ids = [1, 2, ROOT]
    assert spine_token_ids(LEAFY.tree) == SPINE
    feedback.record(token_ids, LEAFY)
    outcome = RoundOutcome.from_committed(LEAFY, new_tokens)
    assert outcome.emitted_token_ids == new_tokens
    feedback.report(outcome, policy)
    assert policy.observed == expected
    feedback.report(outcome, policy)  # reported once only
    assert policy.observed == expected


def test_feedback_ignores_another_root_and_a_reset():
    policy, feedback = RecordingPolicy(StopAt(-1)), SpineFeedback()
    feedback.record([1, 2, ROOT], LEAFY)
    other = DraftTree(TokenTree((ROOT + 1, 10), (-1, 0)))
    feedback.report(RoundOutcome.from_committed(other, [10, 3]), policy)  # not this drafter's round
    feedback.record([1, 2, ROOT], LEAFY)
    feedback.reset()
    feedback.report(RoundOutcome.from_committed(LEAFY, [10, 3]), policy)
    assert policy.observed == []


# --- (a) SVIP thresholds: spines of 1 token or of the full cap, in both drafters --------------------

DRAFTERS = ["model-chain", "model-tree", "glide-chain", "glide-cape"]


def make(kind: str, draft: ModelRunner, glide: GlideDraft | None, shape: DraftShape):
    if kind == "model-chain":
        return model_drafter(draft, shape)
    if kind == "model-tree":
        return model_drafter(draft, replace(shape, widths=(3, 2)))
    return glide_drafter(glide, shape, CapeSettings() if kind == "glide-cape" else None)


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize(
    "depth,settings,spine_length",
    [(4, ALWAYS_STOPS, 1), (4, NEVER_STOPS, 4), (6, StopSettings(svip_h=1e9, max_depth=3), 3)],
    ids=["stops-at-once", "never-stops", "policy-cap"],
)
def test_svip_threshold_sets_the_spine_length(target, draft, glide, kind, depth, settings, spine_length):
    shape = DraftShape(depth=depth, stop=StopPolicyName.SVIP, stop_settings=settings)
    generated, verifier, _ = run(target, make(kind, draft, glide, shape))
    assert verifier.rounds
    for proposal, _ in verifier.rounds:
        assert len(spine_token_ids(proposal.tree)) == spine_length
    reference, _, _ = run(target, lambda verifier, sampling: None)
    assert generated == reference


def test_svip_stop_keeps_the_cape_leaves(target, glide):
    shape = DraftShape(depth=4, stop=StopPolicyName.SVIP, stop_settings=ALWAYS_STOPS)
    _, verifier, _ = run(target, glide_drafter(glide, shape, CapeSettings()))
    for proposal, _ in verifier.rounds:
        assert max(proposal.tree.depths()) == 1
        assert proposal.tree.num_nodes - 1 in (8, 6, 4, 2)  # the CaPE width of depth 1, all kept


# --- (b) observe() gets each round's (drafted, accepted) through the real loop ----------------------


@pytest.mark.parametrize("name", list(STOP_POLICIES))
@pytest.mark.parametrize(
    "kind,params",
    [("model-tree", GREEDY), ("model-chain", SAMPLED), ("glide-cape", GREEDY)],
    ids=["model-tree-greedy", "model-chain-sampled", "glide-cape-greedy"],
)
def test_observe_gets_what_the_verifier_decided(target, draft, glide, name, kind, params):
    # a draft that costs nothing pays every round: the loop asks the drafter each time, whose policy
    # observes every round (a cost policy that drafts nothing is asked less: the loop backs off)
    shape = DraftShape(depth=6, stop=name, stop_settings=StopSettings(max_depth=6, cost_model=FREE_DRAFT))
    recorders: list[RecordingPolicy] = []

    def make_recorded(verifier, sampling):
        drafter = make(kind, draft, glide, shape)(verifier, sampling)
        recorders.append(RecordingPolicy(drafter.stop_policy))
        drafter.stop_policy = recorders[-1]
        return drafter

    _, verifier, _ = run(target, make_recorded, params)
    truth = [true_round(proposal, outcome) for proposal, outcome in verifier.rounds]
    assert recorders[0].observed == truth  # every round, the last one too
    assert len(recorders[0].steps) == sum(drafted for drafted, _ in truth)  # one step per spine token


def test_a_round_is_sized_once_after_the_policy_learned_from_the_last(target, glide):
    """The loop calls propose alone; the draft service opens the round first (to skip waiting for K/V
    when it drafts nothing). Either way the policy sizes each round once, after `observe`."""
    shape = DraftShape(depth=4, stop=StopPolicyName.COST, stop_settings=StopSettings(cost_model=FREE_DRAFT))
    recorders: list[RecordingPolicy] = []

    def make_recorded(verifier, sampling):
        drafter = glide_drafter(glide, shape)(verifier, sampling)
        recorders.append(RecordingPolicy(drafter.stop_policy))
        drafter.stop_policy = recorders[-1]
        return drafter

    _, verifier, drafter = run(target, make_recorded)
    calls = recorders[0].calls
    assert calls.count("start") == len(verifier.rounds)
    assert calls[-1] == "observe"  # the last round's outcome too
    assert all(calls[i + 1] == "start" for i, call in enumerate(calls[:-1]) if call == "observe")
    token_ids = list(verifier.inner.token_ids)
    cap = drafter.open_round(token_ids, 1)
    draft = drafter.propose(token_ids, 1, 1)
    assert calls.count("start") == len(verifier.rounds) + 1
    assert cap == 4 and 1 <= draft.num_draft_tokens <= cap


@pytest.mark.parametrize(
    "kind,params", [("model-tree", GREEDY), ("model-chain", SAMPLED)], ids=["greedy", "sampled"]
)
def test_noisy_draft_rounds_are_fully_partly_and_not_accepted(target, draft, kind, params):
    """Guards the test above: with the learned stopper its model runs see every kind of round."""
    shape = DraftShape(depth=6, stop=StopPolicyName.DECISION, stop_settings=StopSettings(max_depth=6))
    _, verifier, _ = run(target, make(kind, draft, None, shape), params)
    rounds = [true_round(proposal, outcome) for proposal, outcome in verifier.rounds]
    assert any(accepted == drafted for drafted, accepted in rounds)
    assert any(0 < accepted < drafted for drafted, accepted in rounds)
    assert any(accepted == 0 for _, accepted in rounds)


# --- (c) lossless whatever the policy -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(STOP_POLICIES))
@pytest.mark.parametrize("kind", ["model-tree", "glide-cape"])
def test_greedy_output_equals_target_alone_with_every_policy(target, draft, glide, kind, name):
    reference, _, _ = run(target, lambda verifier, sampling: None)
    shape = DraftShape(depth=6, stop=name)
    generated, verifier, _ = run(target, make(kind, draft, glide, shape))
    assert generated == reference
    assert sum(proposal.num_draft_tokens for proposal, _ in verifier.rounds) > 0
