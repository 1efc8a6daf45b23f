"""Where a new session's cost policy starts: the acceptance this service's drafts have shown.

A fresh cost policy's prior is that half of the draft tokens are accepted, until its own rounds say
otherwise (core/stopping.py, CostPolicy; its estimate returns to the prior as its evidence ages). For a
draft that is accepted far less often, every session then drafts its first rounds at a loss: a draft
forward over the whole prompt and its K/V streamed from the target, while other sessions' prompts wait for
the cores. The draft service knows better after its first sessions: each released session's smoothed
acceptance updates a per-method mean, and a new greedy session starts from it. Sampled sessions keep the
fixed start: their trees decide which tokens are drawn, so a seeded request must not depend on what ran
before it (as with the load, docs/adaptive.md).
"""

from __future__ import annotations

import threading

from specserve.core.cost import smoothed
from specserve.core.protocols import CostSizedDrafter, Drafter


class AcceptancePriors:
    def __init__(self) -> None:
        self._means: dict[str, float] = {}  # method -> acceptance of its released sessions, smoothed
        self._lock = threading.Lock()

    def get(self, method: str) -> float | None:
        with self._lock:
            return self._means.get(method)

    def seed(self, method: str, drafter: Drafter) -> None:
        """Starts a new session's greedy cost policy at the method's mean, once there is one."""
        prior = self.get(method)
        if isinstance(drafter, CostSizedDrafter) and prior is not None:
            drafter.start_from(prior)

    def learn(self, method: str, drafter: Drafter) -> None:
        """Folds a finished session's acceptance in, if it drafted at all."""
        if not isinstance(drafter, CostSizedDrafter):
            return
        mean, rounds = drafter.acceptance()
        if rounds == 0:
            return
        with self._lock:
            old = self._means.get(method)
            self._means[method] = mean if old is None else smoothed(old, mean)
