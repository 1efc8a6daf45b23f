"""Stop policies on hand-built distributions whose entropy or token probability is known exactly."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.cost import CostModel, expected_tokens
from specserve.core.decision import DecisionModel
from specserve.core.stopping import (
    STOP_POLICIES,
    AcceptanceEstimate,
    CostPolicy,
    DraftStep,
    RoundPolicy,
    StopPolicy,
    StopPolicyName,
    StopSettings,
    adaedl_stops,
    entropy_nats,
    make_stop_policy,
    needs_decision_model,
    prior_corrected,
    svip_stops,
)
from specserve.errors import InvalidArgument
from specserve.runtime.stopper import make_stop_policy as make_with_shipped_stopper

NEG_INF = float("-inf")


def binary_entropy(p: float) -> float:
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


def logits_with_entropy(entropy: float) -> torch.Tensor:
    """[2] logits of the two-token distribution (1 - p, p), p <= 0.5, with exactly this entropy."""
    assert 0 < entropy < math.log(2)
    low, high = 1e-12, 0.5  # binary entropy rises on (0, 0.5]
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if binary_entropy(mid) < entropy else (low, mid)
    p = (low + high) / 2
    return torch.log(torch.tensor([1 - p, p], dtype=torch.float64))


def logits_with_top_probability(p: float, vocab: int = 4) -> torch.Tensor:
    """[vocab] logits where token 0 has probability p and the rest share 1 - p."""
    rest = (1 - p) / (vocab - 1)
    return torch.log(torch.tensor([p] + [rest] * (vocab - 1), dtype=torch.float64))


def draft_round(policy: StopPolicy, logits_per_depth: list[torch.Tensor], token: int = 0) -> int:
    """A drafter's spine loop: tokens drafted this round (the one that stopped it included)."""
    drafted = 0
    if isinstance(policy, RoundPolicy):
        policy.start_round(1)
    for depth in range(policy.max_depth):
        logits = logits_per_depth[min(depth, len(logits_per_depth) - 1)]
        drafted += 1
        if policy.should_stop(DraftStep(depth, logits, token)):
            break
    return drafted


# --- entropy and probability ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 1000])
def test_uniform_entropy_is_log_n(n):
    assert entropy_nats(torch.zeros(n)) == pytest.approx(math.log(n), abs=1e-12)
    assert entropy_nats(torch.full((n,), 7.5)) == pytest.approx(math.log(n), abs=1e-12)  # shift-invariant


def test_entropy_ignores_minus_infinity():
    assert entropy_nats(torch.tensor([0.0, 0.0, NEG_INF, NEG_INF])) == pytest.approx(math.log(2), abs=1e-12)
    assert entropy_nats(torch.tensor([NEG_INF, 3.0, NEG_INF])) == 0.0  # one-hot: exactly zero, no nan
    with pytest.raises(InvalidArgument):
        entropy_nats(torch.full((3,), NEG_INF))


def test_entropy_of_a_known_two_token_distribution():
    logits = torch.log(torch.tensor([0.9, 0.1]))
    assert entropy_nats(logits) == pytest.approx(binary_entropy(0.1), abs=1e-7)
    assert entropy_nats(logits_with_entropy(0.6)) == pytest.approx(0.6, abs=1e-12)


# --- SVIP ----------------------------------------------------------------------------------------


def test_svip_formula_boundary_is_0_6_nats():
    assert math.isclose(0.3**2 / 0.15, 0.6)  # h^2 / c
    assert not svip_stops(0.599, c=0.15, h=0.3)
    assert svip_stops(0.601, c=0.15, h=0.3)
    assert not svip_stops(0.0, c=0.15, h=0.3)


def test_svip_policy_stops_just_above_0_6_nats():
    policy = make_stop_policy("svip")
    below, above = logits_with_entropy(0.599), logits_with_entropy(0.601)
    assert not policy.should_stop(DraftStep(0, below, 0))
    assert policy.should_stop(DraftStep(0, above, 0))
    assert policy.should_stop(DraftStep(0, torch.zeros(2), 0))  # uniform over 2: ln 2 = 0.693
    assert not policy.should_stop(DraftStep(0, torch.tensor([50.0, 0.0, NEG_INF]), 0))  # H ~ 1e-20


def test_svip_keeps_the_uncertain_token():
    """The module docstring's example: entropies 0.10, 0.35, ln 2, 0.20 -> 3 tokens, the third kept."""
    spine = [logits_with_entropy(0.10), logits_with_entropy(0.35), torch.zeros(2), logits_with_entropy(0.20)]
    assert draft_round(make_stop_policy(StopPolicyName.SVIP), spine) == 3


def test_svip_drafts_to_its_cap_when_sure():
    assert draft_round(make_stop_policy("svip"), [logits_with_entropy(0.1)]) == 40
    assert draft_round(make_stop_policy("svip", StopSettings(max_depth=7)), [logits_with_entropy(0.1)]) == 7


# --- fixed ---------------------------------------------------------------------------------------


def test_fixed_stops_at_its_depth_whatever_the_distribution():
    uncertain = [torch.zeros(1000)]  # H = ln 1000: SVIP would stop at once
    assert draft_round(make_stop_policy("fixed"), uncertain) == 4
    assert draft_round(make_stop_policy("fixed", StopSettings(fixed_depth=3)), uncertain) == 3
    assert draft_round(make_stop_policy("fixed", StopSettings(fixed_depth=6, max_depth=2)), uncertain) == 2


# --- AdaEDL --------------------------------------------------------------------------------------


def test_adaedl_formula_and_svip_special_case():
    assert math.isclose(0.3**2 / 0.2, 0.45)  # factor 0.2, lambda 0.7: stop once H > 0.45
    assert not adaedl_stops(0.449, factor=0.2, lam=0.7)
    assert adaedl_stops(0.451, factor=0.2, lam=0.7)
    for entropy in [0.0, 0.1, 0.5, 0.59, 0.61, 0.7, 2.0, 10.0]:
        assert adaedl_stops(entropy, factor=0.15, lam=0.7) == svip_stops(entropy, c=0.15, h=0.3)


def test_adaedl_lambda_rises_while_acceptance_is_below_target():
    policy = make_stop_policy("adaedl")
    assert policy.max_depth == 40 and policy.lam == 0.7
    nearly_boundary = DraftStep(0, logits_with_entropy(0.448), 0)
    assert not policy.should_stop(nearly_boundary)
    policy.observe(4, 1)  # rate 0.25 (first round taken as is) <= 0.9
    assert policy.acceptance_rate == pytest.approx(0.25)
    assert policy.lam == pytest.approx(0.9 * 0.7 + 0.1 * 0.71)  # 0.701
    assert policy.should_stop(nearly_boundary)  # the boundary moved to 0.299^2 / 0.2 = 0.447
    policy.observe(4, 4)  # rate 0.5 * 0.25 + 0.5 * 1 = 0.625, still below 0.9
    assert policy.acceptance_rate == pytest.approx(0.625)
    assert policy.lam == pytest.approx(0.702)


def test_adaedl_lambda_falls_above_target_and_stays_in_unit_range():
    policy = make_stop_policy("adaedl", StopSettings(adaedl_target_acceptance=0.5))
    policy.observe(5, 5)
    assert policy.lam == pytest.approx(0.699)
    policy.observe(0, 0)  # nothing drafted: no change
    assert policy.lam == pytest.approx(0.699)
    saturated = make_stop_policy("adaedl", StopSettings(adaedl_initial_lambda=1.0))
    saturated.observe(4, 0)
    assert saturated.lam == 1.0


# --- registry and settings -----------------------------------------------------------------------


def test_every_name_is_registered_and_constructs():
    assert set(STOP_POLICIES) == set(StopPolicyName)
    expected_caps = {
        "fixed": 4,
        "svip": 40,
        "adaedl": 40,
        "decision": 20,
        "cost": 16,
        "gated": 4,  # the fixed depth, as `fixed`
    }
    for name in StopPolicyName:
        for key in (name, name.value):
            policy = make_with_shipped_stopper(key)
            assert policy.max_depth == expected_caps[name.value]
            assert isinstance(policy.should_stop(DraftStep(0, torch.zeros(3), 0)), bool)
            policy.observe(2, 1)
        assert make_with_shipped_stopper(name, StopSettings(max_depth=3)).max_depth == 3


def test_core_policies_need_the_stopper_handed_to_them():
    """core/ does no I/O: the decision and cost policies get the learned stopper in their settings."""
    assert needs_decision_model("decision", StopSettings()) and needs_decision_model("cost", StopSettings())
    assert not needs_decision_model("cost", BY_CONFIDENCE)
    assert not needs_decision_model("svip", StopSettings())
    with pytest.raises(InvalidArgument, match="decision_model"):
        make_stop_policy("decision")
    make_stop_policy("cost", BY_CONFIDENCE)  # reads the draft's own probabilities instead


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(InvalidArgument, match="fixed, svip, adaedl, decision, cost"):
        make_stop_policy("oracle")


@pytest.mark.parametrize("name", list(StopPolicyName))
def test_observe_rejects_impossible_rounds(name):
    with pytest.raises(InvalidArgument):
        make_with_shipped_stopper(name).observe(2, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_depth": 0},
        {"fixed_depth": 0},
        {"svip_c": 0.0},
        {"svip_h": -0.1},
        {"adaedl_factor": 0.0},
        {"adaedl_initial_lambda": 1.1},
        {"adaedl_target_acceptance": -0.1},
        {"adaedl_lambda_smoothing": 1.0},
        {"adaedl_acceptance_smoothing": -0.5},
        {"adaedl_step": -0.01},
        {"decision_threshold": 1.2},
        {"cost_acceptance": "oracle"},
    ],
)
def test_settings_are_validated(kwargs):
    with pytest.raises(InvalidArgument):
        StopSettings(**kwargs)


# --- decision: the learned stopper ----------------------------------------------------------------


@pytest.fixture(scope="module")
def entropy_stopper() -> DecisionModel:
    """A hand-set stopper: P(accept) = sigmoid(2 - 10 H). With the 0.4 threshold it stops once
    2 - 10 H <= logit(0.4), i.e. H >= (2 + ln 1.5) / 10 = 0.24055 nats."""
    model = DecisionModel()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.net[0].weight[0, 0] = 1.0  # hidden 0 = relu(entropy)
        model.net[2].weight[0, 0] = -10.0
        model.net[2].bias[0] = 2.0
    model.positive_rate = 0.25
    return model.eval().requires_grad_(False)


DECISION_BOUNDARY = (2 + math.log(1.5)) / 10


@pytest.mark.parametrize("delta,stops", [(-0.002, False), (0.002, True)])
def test_decision_stops_exactly_at_the_threshold(entropy_stopper, delta, stops):
    policy = make_stop_policy("decision", StopSettings(decision_model=entropy_stopper))
    step = DraftStep(0, logits_with_entropy(DECISION_BOUNDARY + delta), 0)
    assert policy.should_stop(step) is stops


def test_decision_threshold_is_a_setting(entropy_stopper):
    # sigmoid(2 - 10 * 0.1) = 0.73: kept at 0.4, stopped at 0.8
    logits = logits_with_entropy(0.1)
    for threshold, stops in [(0.4, False), (0.8, True)]:
        settings = StopSettings(decision_model=entropy_stopper, decision_threshold=threshold)
        assert make_stop_policy("decision", settings).should_stop(DraftStep(0, logits, 0)) is stops


def test_decision_round_drafts_until_the_first_doubtful_token(entropy_stopper):
    policy = make_stop_policy("decision", StopSettings(decision_model=entropy_stopper))
    sure, unsure = logits_with_entropy(0.05), logits_with_entropy(0.5)
    assert draft_round(policy, [sure, sure, sure, unsure, sure]) == 4


def test_prior_correction():
    assert prior_corrected(0.5, 0.5) == 0.5
    assert prior_corrected(0.5, 0.2) == pytest.approx(0.2)  # balanced 50/50 -> the real base rate
    assert prior_corrected(0.8, 0.2) == pytest.approx(4 * 0.25 / (1 + 4 * 0.25))
    assert prior_corrected(1.0, 0.2) == 1.0 and prior_corrected(0.0, 0.9) == 0.0


# --- cost: expected tokens per second --------------------------------------------------------------

# docs/adaptive.md's example: 4 ms per draft step, 60 ms to verify one node, 3 ms per extra node
LINEAR = CostModel(((1, 0.060), (64, 0.060 + 63 * 0.003)), draft_step_s=0.004)
BY_CONFIDENCE = StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE)


def rate_optimal_stop(acceptances: list[float], cap: int) -> int:
    """The rule written out on whole rounds: stop at the first depth d whose rate E_d / T_d no longer
    deepening round d + k (k = 1.., the next tokens predicted like token d) can beat."""

    def rate(spine: list[float]) -> float:
        return expected_tokens(spine) / LINEAR.round_s(len(spine), len(spine) + 1)

    for d in range(1, cap + 1):
        spine = acceptances[:d]
        longer = [spine + [spine[-1]] * k for k in range(1, cap - d + 1)]
        if all(rate(s) <= rate(spine) for s in longer):
            return d
    return cap


@pytest.mark.parametrize(
    "acceptances",
    [[0.9, 0.9, 0.1, 0.9], [0.9] * 16, [0.6] * 16, [0.95, 0.95, 0.3, 0.95, 0.95], [0.2] * 16],
    ids=str,
)
def test_cost_round_stops_where_the_rate_would_fall(acceptances):
    policy = make_stop_policy("cost", BY_CONFIDENCE)
    logits = [logits_with_top_probability(a) for a in acceptances]
    assert draft_round(policy, logits) == rate_optimal_stop(acceptances, policy.max_depth)


def test_cost_worked_example():
    # a = .9, .9, .1: after the third token E = 2.791 in .081 s; a fourth (a = .1) adds .0081 for .007 s
    policy = make_stop_policy("cost", BY_CONFIDENCE)
    sure, unsure = logits_with_top_probability(0.9), logits_with_top_probability(0.1)
    assert draft_round(policy, [sure, sure, unsure, sure]) == 3
    assert 5 < draft_round(policy, [sure]) < policy.max_depth  # even sure tokens stop paying


@pytest.mark.parametrize("delta,depth", [(-0.005, 1), (0.005, 2)])
def test_cost_first_token_threshold_is_the_formulas(delta, depth):
    """One more token with acceptance a pays iff .067 a^2 > .007 (1 + a): a > 0.3797 (and at such an a
    a third does not: .074 a^3 < .007 (1 + a + a^2))."""
    t, dt = 0.067, 0.007
    threshold = (dt + math.sqrt(dt * dt + 4 * t * dt)) / (2 * t)
    policy = make_stop_policy("cost", BY_CONFIDENCE)
    assert draft_round(policy, [logits_with_top_probability(threshold + delta)]) == depth


def test_cost_keeps_leaves_while_they_beat_the_rate():
    """Draft probabilities .5, .3, .15, .05 and a CaPE width of 4: after the spine E = 1.5 in .067 s
    (22.4 tok/s); leaf .3 adds 100 tok/s at the margin (kept, 25.7 tok/s), .15 adds 50 (kept, 26.7),
    .05 adds 16.7 (dropped)."""
    policy = make_stop_policy("cost", BY_CONFIDENCE)
    assert isinstance(policy, CostPolicy)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    assert policy.choose_width(0, logits, 4) == 3
    assert policy.expected == pytest.approx(1.95) and policy.num_nodes == 4
    assert policy.choose_width(0, logits, 1) == 1  # a new round starts at depth 0; width 1 stays 1
    assert policy.num_nodes == 2


def test_cost_with_the_learned_stopper_uses_corrected_predictions(entropy_stopper):
    settings = StopSettings(cost_model=LINEAR, decision_model=entropy_stopper)
    policy = make_stop_policy("cost", settings)
    logits = logits_with_entropy(0.1)  # model says .731; the base rate .25 corrects it to .475
    expected = prior_corrected(1 / (1 + math.exp(-1.0)), 0.25)
    assert policy.acceptance(logits, 0) == pytest.approx(expected, rel=1e-5)


# --- the gated chain -------------------------------------------------------------------------------

# A one-token verify costs 1; each further node 0.1; a draft step 0.3 (the 1.5B's sibling, in steps).
GATED_COST = CostModel(((1, 1.0), (2, 1.1), (3, 1.2), (32, 4.1)), draft_step_s=0.3)


def gated(depth: int = 2, prior: float = 0.5) -> CostPolicy:
    policy = make_stop_policy(StopPolicyName.GATED, StopSettings(fixed_depth=depth, cost_model=GATED_COST))
    assert isinstance(policy, CostPolicy)
    policy.mean_acceptance = prior
    return policy


def test_a_gated_round_drafts_the_whole_depth_whatever_the_drafts_confidence():
    policy = gated(depth=2, prior=0.7)
    unsure = logits_with_top_probability(0.3)
    assert draft_round(policy, [unsure]) == 2  # the cost policy would stop here: the chain does not
    assert policy.num_nodes == 3


def test_a_gated_round_keeps_the_trees_own_widths():
    policy = gated(depth=2, prior=0.7)
    policy.start_round(1)
    logits = logits_with_top_probability(0.3)
    assert policy.choose_width(0, logits, 3) == 3  # CaPE's width, not trimmed
    assert not policy.should_stop(DraftStep(0, logits, 0))
    assert policy.choose_width(1, logits, 2) == 2
    assert policy.num_nodes == 1 + 3 + 2


def test_the_gate_opens_where_a_drafted_token_pays():
    # one token: a over 0.3 + 0.1 against 1 over 1 (two: a + a^2 over 0.8, which needs more)
    assert gated(prior=0.41).start_round(1) == 1
    assert gated(prior=0.39).start_round(1) == 0


@pytest.mark.parametrize(("prior", "depth"), [(0.41, 1), (0.69, 1), (0.71, 2), (0.9, 2)])
def test_a_gated_round_drafts_the_depth_whose_round_earns_most(prior, depth):
    """(1 + a) / 1.4 for one token, (1 + a + a^2) / 1.8 for two: two earn more from a = 0.70 on. A round
    of the whole depth where only one token pays would earn less than the root alone at a = 0.41."""
    policy = gated(depth=2, prior=prior)
    assert policy.start_round(1) == depth
    assert draft_round(policy, [logits_with_top_probability(0.3)] * 2) == depth


def test_the_gate_closes_under_a_batch_that_already_earns_more():
    policy = gated(prior=0.75)
    assert policy.start_round(1) == 2
    policy.observe(2, 2)  # rounds of 3 nodes that emit 3 tokens: the batch is assumed to send the same
    assert policy.start_round(16) == 0
    assert 1 <= policy.largest_drafting_batch(16) < 15


def test_the_gates_acceptance_is_a_chains_per_token_rate():
    """Rounds of 2 accepting 2, 1, 0, 2, 1 tokens: 6 accepted, 3 rounds stopped short: a = 6 / 9 of the
    evidence (with the prior's 2 tokens at 0.5 beside it), where accepted / drafted reads 6 / 10."""
    policy = gated(prior=0.5)
    for accepted in (2, 1, 0, 2, 1):
        policy.start_round(1)
        policy.observe(2, accepted)
    geometric = policy.mean_acceptance
    ratio = CostPolicy.mean_acceptance.fget(policy)  # type: ignore[attr-defined]
    assert ratio < geometric
    decay = [0.9**k for k in range(5)][::-1]  # each round one older than the next
    accepted = sum(d * a for d, a in zip(decay, (2, 1, 0, 2, 1), strict=True))
    stopped = sum(d for d, a in zip(decay, (2, 1, 0, 2, 1), strict=True) if a < 2)
    assert geometric == pytest.approx((1.0 + accepted) / (2.0 + accepted + stopped))
    policy.mean_acceptance = 0.9  # a service's prior starts the estimate over
    assert policy.mean_acceptance == pytest.approx(0.9)
