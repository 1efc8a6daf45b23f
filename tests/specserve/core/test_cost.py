"""The cost model: calibrated curve, expected tokens, and the extend / keep-leaf rules on hand numbers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from specserve.core.cost import (
    BatchLoad,
    CostModel,
    best_extension,
    expected_tokens,
    leaves_worth_adding,
    worth_extending,
)
from specserve.core.stopping import COST_MAX_DEPTH, AcceptanceEstimate, CostPolicy, StopSettings
from specserve.errors import InvalidArgument, NotFound
from specserve.runtime.calibrate import load_calibration, measure_draft_costs

# The worked example of docs/adaptive.md: 4 ms per draft step, 60 ms for one verified node, +3 ms a node.
LINEAR = CostModel(((1, 0.060), (64, 0.060 + 63 * 0.003)), draft_step_s=0.004)


def test_verify_cost_interpolates_extrapolates_and_floors():
    cost = CostModel(((1, 1.0), (16, 1.6), (32, 2.0)), draft_step_s=0.1)
    assert cost.verify_s(1) == 1.0 and cost.verify_s(16) == 1.6
    assert cost.verify_s(8) == pytest.approx(1.0 + 0.6 * 7 / 15)
    assert cost.verify_s(64) == pytest.approx(2.0 + 0.025 * 32)  # the last segment's slope
    assert cost.verify_s(0) == 1.0
    assert cost.round_s(num_spine=3, num_nodes=16) == pytest.approx(0.3 + 1.6)


def test_calibration_json_round_trip(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text('{"verify_s": {"4": 0.2, "1": 0.1}, "draft_step_s": 0.01, "threads": 2}')
    cost = load_calibration(path)
    assert cost.verify_points == ((1, 0.1), (4, 0.2))
    assert cost.draft_overhead_s == 0.0  # a file from before the overhead was measured
    assert CostModel.from_json(cost.to_json()) == cost
    measured = CostModel(cost.verify_points, 0.01, draft_overhead_s=0.003)
    assert CostModel.from_json(measured.to_json()) == measured


def test_draft_costs_are_the_slope_and_what_is_left_of_the_short_proposal():
    """A drafter whose proposals take 4 ms plus 2 ms a token (sleeps: best of 3 keeps the least
    disturbed)."""
    import time

    def propose(depth: int) -> None:
        time.sleep(0.004 + 0.002 * depth)

    step, overhead = measure_draft_costs(propose, repeats=3)  # type: ignore[arg-type]
    assert step == pytest.approx(0.002, abs=0.0005)
    assert overhead == pytest.approx(0.004, abs=0.0015)


def test_draft_costs_are_timed_after_the_draft_has_run_a_while_not_right_after_larger_work():
    """A drafter on a host that has just run large target forwards (the calibration's verify curve): its
    first forwards run slow, the slowdown halving with each one. A proposal costs 4 units plus 2 a
    token. Timed block by block from the short proposal on, right after that work, the short one's
    calls were the slow ones and read as fixed cost (on an Intel Xeon the 1.5B's drafts read 0.6-4.4 ms
    a proposal that way, 0.0-0.3 round-robin); timed round-robin after a pass of both, they read the
    drafter's own costs."""
    now, slow = [0.0], [100.0]

    def propose(depth: int) -> None:
        now[0] += 4.0
        for _ in range(depth):
            now[0] += 2.0 + slow[0]
            slow[0] /= 2

    step, overhead = measure_draft_costs(propose, repeats=3, clock=lambda: now[0])  # type: ignore[arg-type]
    assert step == pytest.approx(2.0, abs=0.01)
    assert overhead == pytest.approx(4.0, abs=0.05)


def test_a_calibrated_draft_overhead_is_charged_in_process():
    """Alone, 1/0.060 = 16.7 tok/s. With 6 ms of fixed drafting cost per round, a first token of
    acceptance 0.3 pays 0.3 / 0.013 = 23 tok/s at the margin; at 0.1, 7.7 tok/s: no round drafts."""
    cost = CostModel(LINEAR.verify_points, LINEAR.draft_step_s, draft_overhead_s=0.006)
    policy = CostPolicy(StopSettings(cost_model=cost, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    policy.batch_aware = False  # sampled requests weigh it too: it is a calibrated constant, not timing
    policy.mean_acceptance = 0.3
    assert policy.start_round(1) == COST_MAX_DEPTH
    policy.mean_acceptance = 0.1
    assert policy.start_round(1) == 0


@pytest.mark.parametrize(
    "points,draft",
    [((), 0.1), (((2, 1.0), (1, 2.0)), 0.1), (((1, 0.0),), 0.1), (((1, 1.0),), -1.0), (((0, 1.0),), 0.1)],
)
def test_bad_calibrations_are_refused(points, draft):
    with pytest.raises(InvalidArgument):
        CostModel(points, draft)


def test_missing_calibration_is_not_found(tmp_path):
    with pytest.raises(NotFound):
        load_calibration(tmp_path / "none.json")


def test_expected_tokens_by_hand():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45)
    # leaves beside token 2 add 0.2, reached with probability 0.9
    assert expected_tokens([0.9, 0.5], [0.0, 0.2]) == pytest.approx(1 + 0.9 + 0.9 * (0.5 + 0.2))


def threshold_acceptance() -> float:
    """After one token with acceptance a, one more (also a) pays iff a^2 T > (1 + a) dT with T = 0.067,
    dT = 0.007 (extending further only adds smaller gains at the same price on a linear curve)."""
    t, dt = 0.004 + 0.063, 0.007
    return (dt + math.sqrt(dt * dt + 4 * t * dt)) / (2 * t)  # root of t a^2 - dt a - dt = 0: ~0.380


@pytest.mark.parametrize("delta,extends", [(-0.005, False), (0.005, True)])
def test_extending_flips_exactly_at_the_formulas_threshold(delta, extends):
    a = threshold_acceptance() + delta
    assert worth_extending(LINEAR, 1 + a, a, a, num_spine=1, num_nodes=2, max_more=10) is extends


def test_worked_example_of_the_docs():
    # token 1 (a = .9): E = 1.9, T = .067: a second .9 token adds .81 for .007 s
    assert worth_extending(LINEAR, 1.9, 0.9, 0.9, 1, 2, max_more=7)
    # token 3 (a = .1) after two .9 tokens: E = 2.791, T = .081 (34.5 tok/s); another .1 token adds .0081
    e = expected_tokens([0.9, 0.9, 0.1])
    assert e == pytest.approx(2.791)
    assert not worth_extending(LINEAR, e, 0.081, 0.1, 3, 4, max_more=5)


def test_no_room_left_never_extends():
    assert not worth_extending(LINEAR, 1.99, 0.99, 0.99, 1, 2, max_more=0)


def test_lookahead_sees_past_a_step_in_the_cost_curve():
    """A GPU-like curve: flat to 8 nodes, then a jump. One more token (2 -> 3 nodes) is free, so even a
    poor next token pays; with the jump right after the current size only a longer extension can pay."""
    stepped = CostModel(((1, 1.0), (2, 1.0), (3, 1.6), (16, 1.6)), draft_step_s=0.0)
    # at 2 nodes, the next node costs .6 (a 60% jump) but 13 more cost nothing beyond it
    e, reach = 1.8, 0.8
    one_step = worth_extending(stepped, e, reach, 0.8, 1, 2, max_more=1)
    many = worth_extending(stepped, e, reach, 0.8, 1, 2, max_more=10)
    assert not one_step and many


def test_the_best_extension_is_the_count_whose_round_earns_most():
    """From the root (E = 1, T = 1) with a = .8 and a draft step of .1: one token earns 1.8 / 1.2, two
    2.44 / 1.7, three 2.952 / 1.8 (the curve flat from 3 to 4 nodes): three, though two earn less than
    one."""
    curve = CostModel(((1, 1.0), (2, 1.1), (3, 1.5), (4, 1.5), (16, 3.0)), draft_step_s=0.1)
    assert best_extension(curve, 1.0, 1.0, 0.8, 0, 1, max_more=1) == 1
    assert best_extension(curve, 1.0, 1.0, 0.8, 0, 1, max_more=2) == 1
    assert best_extension(curve, 1.0, 1.0, 0.8, 0, 1, max_more=3) == 3
    assert best_extension(curve, 1.0, 1.0, 0.1, 0, 1, max_more=3) == 0  # none beats the root alone


def test_leaf_rule_by_hand():
    # after a spine token with a = .5: E = 1.5, T = .067 (22.4 tok/s); a leaf adds its gain for .003 s:
    # .3 (100 tok/s marginal, kept: 25.7), .15 (50, kept: 26.7), .05 (16.7 < 26.7: not kept)
    assert leaves_worth_adding(LINEAR, 1.5, [0.3, 0.15, 0.05], num_spine=1, num_nodes=2) == 2
    assert leaves_worth_adding(LINEAR, 1.95, [0.05], num_spine=1, num_nodes=4) == 0
    assert leaves_worth_adding(LINEAR, 1.5, [], num_spine=1, num_nodes=2) == 0


def test_leaves_use_a_dip_in_the_cost_curve():
    """Measured on a 2-core AMD EPYC in fp32 (docs/benchmarks.md): 8 nodes verify faster than 7. From 6
    nodes, one leaf costs a lot, a second makes the forward cheaper than now, so two pay where one alone
    does not."""
    dipped = CostModel(((1, 0.055), (6, 0.090), (7, 0.110), (8, 0.080)), draft_step_s=0.004)
    expected = 1.5
    assert leaves_worth_adding(dipped, expected, [0.05], num_spine=1, num_nodes=6) == 0
    assert leaves_worth_adding(dipped, expected, [0.05, 0.01], num_spine=1, num_nodes=6) == 2


def test_leaf_count_is_the_best_rate_of_every_count():
    curve = CostModel(((1, 0.05), (3, 0.09), (4, 0.07), (9, 0.12), (10, 0.08)), draft_step_s=0.003)
    gains = [0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01, 0.005]
    count = leaves_worth_adding(curve, 1.3, gains, num_spine=1, num_nodes=2)

    def rate(k: int) -> float:
        return (1.3 + sum(gains[:k])) / curve.round_s(1, 2 + k)

    assert rate(count) == max(rate(k) for k in range(len(gains) + 1))


def test_cost_module_needs_no_torch():
    code = "import sys; import specserve.core.cost; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_load_by_hand():
    """Alone, a token of acceptance 0.5 pays: E 1 -> 1.5 for 7 ms on 64 ms (23.4 -> ... marginal 71 tok/s).
    Beside 31 sessions of 4 nodes emitting 1.5 tokens each, the batch makes 47.5 tokens per 0.433 s
    (110 tok/s); the same token adds 0.5 tokens for 7 ms (71 tok/s): it no longer pays."""
    assert worth_extending(LINEAR, 1.0, 1.0, 0.5, 0, 1, 1)
    crowd = BatchLoad(other_nodes=124, other_expected=46.5)
    assert not worth_extending(LINEAR, 1.0, 1.0, 0.5, 0, 1, 1, crowd)
    # a sure token still pays: 1 token for 7 ms (143 tok/s) beats 110 tok/s
    assert worth_extending(LINEAR, 1.0, 1.0, 1.0, 0, 1, 1, crowd)


def test_leaves_shrink_as_the_batch_grows():
    gains = [0.3, 0.2, 0.1, 0.05]
    counts = [
        leaves_worth_adding(LINEAR, 1.8, gains, 1, 2, BatchLoad(others * 4, others * 1.5))
        for others in (0, 4, 16, 64)
    ]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 0


def test_a_negative_load_is_refused():
    with pytest.raises(InvalidArgument):
        BatchLoad(other_nodes=-1)


def test_cost_policy_stops_speculating_under_heavy_load():
    policy = CostPolicy(StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    assert policy.start_round(1) == COST_MAX_DEPTH  # alone: the cost curve decides round by round
    assert policy.start_round(64) == 0  # 63 others: not even one token is worth its share of the forward
    with pytest.raises(InvalidArgument):
        policy.start_round(0)  # the session itself is in its batch


@pytest.mark.parametrize("acceptance", [0.3, 0.6, 0.9])
def test_the_largest_drafting_batch_is_where_rounds_start_drafting_again(acceptance):
    policy = CostPolicy(StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    policy.mean_acceptance = acceptance
    assert policy.start_round(64) == 0
    largest = policy.largest_drafting_batch(64)
    assert 1 <= largest < 64
    assert policy.start_round(largest + 1) == 0  # one session more than the largest drafting batch
    assert policy.start_round(largest) == COST_MAX_DEPTH
    policy.batch_aware = False  # sampled: sized as if alone, so the load never matters
    policy.transport_s = 1.0  # and a round trip of a second never pays, alone or not
    policy.cost = CostModel(LINEAR.verify_points, LINEAR.draft_step_s, draft_overhead_s=1.0)
    assert policy.start_round(1) == 0 and policy.largest_drafting_batch(64) == 0


def test_the_largest_drafting_batch_is_the_same_whatever_bounds_it_on_a_curve_with_a_dip():
    # A measured curve that dips (oneDNN on an AVX2 CPU verified 9-13 nodes faster than 8): a token pays
    # at 1-2 sessions, not at 3, and pays again at 4-8, whose forwards can grow onto the cheap 9+ nodes.
    # Bisection answered 8 when bounded by 64 sessions and 2 when bounded by 3; the router relies on "it
    # drafts at every load up to n".
    dip = CostModel(
        ((1, 1.0), (2, 1.08), (3, 1.2), (4, 1.5), (8, 2.2), (9, 1.3), (13, 1.4), (64, 4.0)),
        draft_step_s=0.11,
    )
    policy = CostPolicy(StopSettings(cost_model=dip, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    policy.mean_acceptance = 0.5
    drafts = [policy._drafts_under(policy._load_beside(others)) for others in range(10)]
    assert drafts == [True, True, False, *[True] * 5, False, False]  # the dip, as designed
    assert [policy.largest_drafting_batch(n) for n in (64, 9, 4, 3)] == [2, 2, 2, 2]
    assert policy.largest_drafting_batch(2) == 1 and policy.largest_drafting_batch(1) == 0


def test_sampled_requests_size_trees_as_if_alone():
    """Under sampling the tree decides which tokens are drawn: a seeded request must not depend on load."""
    policy = CostPolicy(StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    assert policy.start_round(64) == 0
    policy.batch_aware = False
    assert policy.start_round(64) == COST_MAX_DEPTH


def test_the_overhead_of_asking_the_drafter_is_charged_once_per_drafting_round():
    with_overhead = CostModel(LINEAR.verify_points, LINEAR.draft_step_s, draft_overhead_s=0.020)
    assert with_overhead.round_s(0, 1) == LINEAR.round_s(0, 1) == 0.060  # no draft, no overhead
    assert with_overhead.round_s(2, 3) == pytest.approx(0.020 + 2 * 0.004 + 0.066)


def test_a_draft_that_does_not_pay_for_its_round_trip_drafts_nothing():
    """Alone, 1/0.060 = 16.7 tok/s. A first token of acceptance 0.3 costs 0.004 + 0.003 s: 43 tok/s at
    the margin, worth drafting in process; behind a 20 ms round trip, 0.3 / 0.027 = 11 tok/s (and no
    longer chain does better): not worth asking at all. Acceptance 0.6 still pays (22 tok/s)."""
    policy = CostPolicy(StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    policy.mean_acceptance = 0.3
    assert policy.start_round(1) == COST_MAX_DEPTH
    policy.transport_s = 0.020
    assert policy.start_round(1) == 0
    policy.mean_acceptance = 0.6
    assert policy.start_round(1) == COST_MAX_DEPTH
    policy.mean_acceptance = 0.3
    policy.batch_aware = False  # sampled: the overhead depends on timing, so it is not weighed
    assert policy.start_round(1) == COST_MAX_DEPTH


def test_another_drafts_step_replaces_the_glide_drafts_and_survives_json() -> None:
    cost = CostModel(((1, 0.05), (8, 0.06)), 0.004, 0.001, (("eagle", 0.003, 0.002),))
    eagle = cost.for_draft("eagle")
    assert (eagle.draft_step_s, eagle.draft_overhead_s) == (0.003, 0.002)
    assert eagle.verify_points == cost.verify_points
    assert cost.for_draft("unmeasured") is cost
    assert CostModel.from_json(cost.to_json()) == cost
    assert "other_drafts" not in CostModel(((1, 0.05),), 0.004).to_json()


def test_a_session_that_stopped_drafting_probes_again():
    """Alone with 6 ms of fixed drafting cost per round a token needs an acceptance above about 0.14 to
    pay (test above). A run of rejected rounds pushes the estimate under that and the session stops
    drafting, which also stops new evidence: the estimate must not freeze there. Aged, it drifts back
    to the prior, a later round drafts again, and accepted rounds keep it drafting. (With a running mean
    of drafting rounds only, the first rejections stopped the session for good.)"""
    cost = CostModel(LINEAR.verify_points, LINEAR.draft_step_s, draft_overhead_s=0.006)
    policy = CostPolicy(StopSettings(cost_model=cost, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    assert policy.start_round(1) == COST_MAX_DEPTH  # the prior, 0.5
    for _ in range(6):
        policy.observe(2, 0)  # two spine tokens drafted, none accepted
        policy.start_round(1)
    assert policy.mean_acceptance < 0.14
    caps = []
    for _ in range(40):
        policy.observe(0, 0)  # a round of the root alone: nothing drafted, nothing learned
        caps.append(policy.start_round(1))
    probe = caps.index(COST_MAX_DEPTH)  # it drafts again, after a while: not at once
    assert probe > 0 and all(cap == 0 for cap in caps[:probe])
    for _ in range(20):
        policy.observe(1, 1)  # now its tokens are accepted
        assert policy.start_round(1) == COST_MAX_DEPTH
    assert policy.mean_acceptance > 0.8


def test_the_acceptance_estimate_weighs_recent_rounds_more_and_starts_from_its_prior():
    policy = CostPolicy(StopSettings(cost_model=LINEAR, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    assert policy.mean_acceptance == 0.5
    policy.mean_acceptance = 0.2  # a prior, e.g. the draft service's mean for the method
    assert policy.mean_acceptance == 0.2 and policy.prior_acceptance == 0.2
    for accepted in (4, 4, 4, 0, 0):  # good rounds, then bad ones
        policy.observe(4, accepted)
        policy.start_round(1)
    late_bad = policy.mean_acceptance
    policy.mean_acceptance = 0.2
    for accepted in (0, 0, 4, 4, 4):  # the same rounds, bad ones first
        policy.observe(4, accepted)
        policy.start_round(1)
    assert 0.2 < late_bad < policy.mean_acceptance < 1.0
    with pytest.raises(InvalidArgument):
        policy.mean_acceptance = 1.5


def test_alone_a_draft_without_fixed_cost_drafts_only_where_its_first_step_pays():
    """A draft step as dear as a target step (a hidden-state draft beside a 4-bit target on a CPU), no
    fixed cost measured: even at 90% acceptance the first token's step does not pay, and the round sends
    the root alone; a draft step a tenth of that pays at 90% and not at 5%."""
    curve = ((1, 0.005), (2, 0.0051), (8, 0.009))

    def cap(step_s: float, acceptance: float) -> int:
        cost = CostModel(curve, draft_step_s=step_s, draft_overhead_s=0.0)
        policy = CostPolicy(StopSettings(cost_model=cost, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
        policy.mean_acceptance = acceptance
        return policy.start_round(1)

    assert cap(0.005, 0.9) == 0
    assert cap(0.0005, 0.9) == COST_MAX_DEPTH
    assert cap(0.0005, 0.05) == 0
