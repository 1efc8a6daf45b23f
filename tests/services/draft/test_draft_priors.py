"""A new greedy session's cost policy starts from the acceptance the service's earlier sessions showed."""

from __future__ import annotations

import pytest

from services.draft.priors import AcceptancePriors
from specserve.core.protocols import CandidateKind
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stopping import AcceptanceEstimate, CostPolicy, StopSettings
from specserve.runtime.drafter import PolicyDrafter


def session(greedy: bool = True) -> PolicyDrafter:
    """A drafter with a cost policy, as the cost methods build one (it never drafts here)."""
    policy = CostPolicy(StopSettings(cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    sampling = GREEDY if greedy else SamplingParams(temperature=1.0)
    return PolicyDrafter(CandidateKind.SAMPLED, policy, sampling)


def test_a_new_greedy_session_starts_from_what_finished_sessions_accepted():
    priors = AcceptancePriors()
    fresh = session()
    priors.seed("glide-cape-cost", fresh)
    assert fresh.stop_policy.mean_acceptance == 0.5  # nothing learned yet: the policy's own start
    never_drafted = session()
    priors.learn("glide-cape-cost", never_drafted)  # a session the load kept from drafting says nothing
    assert priors.get("glide-cape-cost") is None

    finished = session()
    for _ in range(10):
        finished.stop_policy.observe(4, 1)
    learned = finished.stop_policy.mean_acceptance
    assert learned < 0.3
    priors.learn("glide-cape-cost", finished)
    assert priors.get("glide-cape-cost") == learned
    assert priors.get("glide-cape") is None  # per method

    new = session()
    priors.seed("glide-cape-cost", new)
    assert new.stop_policy.mean_acceptance == learned
    sampled = session(greedy=False)
    priors.seed("glide-cape-cost", sampled)  # a seeded sampled request must not depend on earlier ones
    assert sampled.stop_policy.mean_acceptance == 0.5


def test_later_sessions_move_the_prior_smoothly():
    priors = AcceptancePriors()
    low, high = session(), session()
    for _ in range(20):
        low.stop_policy.observe(4, 0)
        high.stop_policy.observe(4, 4)
    priors.learn("m", low)
    priors.learn("m", high)
    prior = priors.get("m")
    assert prior == pytest.approx(
        0.8 * low.stop_policy.mean_acceptance + 0.2 * high.stop_policy.mean_acceptance
    )
