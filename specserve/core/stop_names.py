"""The stop policies' names, torch-free: a method's `stop` axis (specserve/method_axes.py, which the
router validates with) names one, and core/stopping.py registers one policy for each."""

from __future__ import annotations

from enum import StrEnum


class StopPolicyName(StrEnum):
    FIXED = "fixed"  # every round drafts the whole depth
    SVIP = "svip"  # SVIP's entropy rule
    ADAEDL = "adaedl"  # AdaEDL's entropy bound, its lambda adapted online
    DECISION = "decision"  # the learned stopper (specserve train-stopper)
    COST = "cost"  # expected tokens per second on this machine's calibrated costs
    GATED = "gated"  # the whole depth when a round of it raises the expected tokens per second, else none

    @property
    def adaptive(self) -> bool:
        """Whether the policy decides each round's length (else every round drafts the whole depth)."""
        return self is not StopPolicyName.FIXED

    @property
    def whole_depth(self) -> bool:
        """Whether a round that drafts drafts the whole depth (so a method's depth is the tree's fixed one
        when none is named)."""
        return self in (StopPolicyName.FIXED, StopPolicyName.GATED)
