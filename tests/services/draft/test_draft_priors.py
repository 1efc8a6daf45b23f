"""A new greedy session's cost policy starts from the acceptance the service's earlier sessions showed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.draft.priors import AcceptancePriors
from specserve.core.stopping import AcceptanceEstimate, CostPolicy, StopSettings


@dataclass
class PolicyHolder:
    """What the priors read of a drafter: its stop policy (drafters expose it as `stop_policy`)."""

    stop_policy: CostPolicy

    def propose(self, token_ids, round_seed):  # the Drafter protocol; never drafted here
        raise NotImplementedError

    def release(self) -> None: ...


def session(greedy: bool = True) -> PolicyHolder:
    policy = CostPolicy(StopSettings(cost_acceptance=AcceptanceEstimate.CONFIDENCE))
    policy.batch_aware = greedy  # as GlideDrafter sets it from the session's sampling
    return PolicyHolder(policy)


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
