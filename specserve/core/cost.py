"""Cost-aware drafting: grow a round only while it raises the expected tokens per second.

A round that drafted d spine tokens with predicted acceptances a_1..a_d (a_i: the chance the target
accepts token i given that tokens 1..i-1 were accepted) and, with CaPE, leaves of predicted acceptance
l_{i,j} beside spine token i, emits in expectation

    E = 1 + sum_i P_{i-1} (a_i + sum_j l_{i,j}),   P_i = a_1 ... a_i   (P_0 = 1)

tokens (the 1 is the bonus or recovered token, always emitted; a leaf ends the path, so only the spine
carries P on) and costs

    T = draft_overhead_s [d > 0] + draft_step_s * d + verify_s(n)      (n = tree nodes, root included)

seconds, verify_s being the calibrated cost of one target forward over n tree nodes on this machine, and
draft_overhead_s what asking the drafter costs a round at all (in process the calibrated fixed part of a
proposal: re-encoding the root, the policy's bookkeeping; through the stack the Propose round trip the
router measures, docs/adaptive.md).
Growing by anything with expected gain dE and cost dT raises the rate iff dE / dT > E / T (the marginal
rate beats the current one). After each spine token the policy looks ahead k = 1..K more spine tokens,
assuming each is accepted with the last prediction a: dE_k = P_d (a + a^2 + ... + a^k),
dT_k = k draft_step_s + verify_s(n + k) - verify_s(n); it stops when no k beats the current rate
(one-step lookahead alone would miss a curve that is flat after a step, e.g. a GPU's). Leaves are taken
in order of draft probability: as many as give the round its highest rate (every count is compared, so
a curve with a dip, cheaper at 8 nodes than at 7, is used).

Worked example (docs/adaptive.md has it in full): draft_step_s = 0.004, verify_s(1) = 0.060, rising by
0.003 per node. One token with a = 0.9: E = 1.9, T = 0.004 + 0.063 = 0.067, 28.4 tok/s. A second token
with a = 0.9 would add 0.81 tokens for 0.007 s (116 tok/s marginal): continue. With a = 0.1 a further
token would add 0.09 tokens for 0.007 s, 12.9 tok/s, below the current rate: stop.

Under continuous batching the round shares one target forward with the other sessions' trees
(`BatchLoad`): the forward costs verify_s(n + n_others), the batch emits E + E_others, and a token is
worth drafting iff it raises the batch's rate, dE / dT > (E + E_others) / T. As load grows, E_others / T
approaches what plain batched decoding already earns per second, and a token's marginal cost approaches
one token's share of a compute-bound forward, so trees shrink, down to no speculation at all
(docs/adaptive.md, "Batches").

Pure Python (no torch, no I/O): specserve.runtime.calibrate measures, saves and loads calibrations.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.errors import InvalidArgument


@dataclass(frozen=True)
class CostModel:
    """Calibrated costs: one target forward over n tree nodes, one draft step, and what a round that
    drafts anything pays once for asking the drafter in process (seconds). A caller that knows its
    transport costs more (the router's Propose round trip) replaces the last."""

    verify_points: tuple[tuple[int, float], ...]  # (num_nodes, seconds), num_nodes increasing
    draft_step_s: float
    draft_overhead_s: float = 0.0
    # Other drafts' (kind, step seconds, overhead seconds), e.g. the hidden-state draft's ("eagle", ...);
    # draft_step_s / draft_overhead_s are the GliDe draft's.
    other_drafts: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.verify_points]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise InvalidArgument(f"verify points need increasing node counts >= 1, got {sizes}")
        if any(s <= 0 for _, s in self.verify_points) or min(self.draft_step_s, self.draft_overhead_s) < 0:
            raise InvalidArgument("verify costs must be > 0, the draft step and overhead costs >= 0")

    def verify_s(self, num_nodes: int) -> float:
        """Piecewise linear through the calibrated points; extrapolated with the last segment's slope
        beyond the largest, and flat below the smallest (a forward never costs less than one token's)."""
        points = self.verify_points
        if num_nodes <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (n0, s0), (n1, s1) in itertools.pairwise(points):
            if num_nodes <= n1:
                return s0 + (s1 - s0) * (num_nodes - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (num_nodes - n1)

    def for_draft(self, kind: str) -> CostModel:
        """The same costs with `kind`'s draft step; unchanged where that draft was never measured (a
        calibration written before it existed: drafts of one decoder layer cost about the same)."""
        for name, step, overhead in self.other_drafts:
            if name == kind:
                return replace(self, draft_step_s=step, draft_overhead_s=overhead)
        return self

    def round_s(self, num_spine: int, num_nodes: int) -> float:
        overhead = self.draft_overhead_s if num_spine > 0 else 0.0
        return overhead + self.draft_step_s * num_spine + self.verify_s(num_nodes)

    def to_json(self) -> dict:
        return {
            "verify_s": {str(n): s for n, s in self.verify_points},
            "draft_step_s": self.draft_step_s,
            "draft_overhead_s": self.draft_overhead_s,
            **({"other_drafts": {k: [s, o] for k, s, o in self.other_drafts}} if self.other_drafts else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        try:
            points = sorted((int(n), float(s)) for n, s in data["verify_s"].items())
            overhead = float(data.get("draft_overhead_s", 0.0))  # files written before it was measured
            others = tuple(
                (str(kind), float(step), float(over))
                for kind, (step, over) in data.get("other_drafts", {}).items()
            )
            return cls(tuple(points), float(data["draft_step_s"]), overhead, others)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidArgument(f"not a cost calibration: {e}") from None


GLIDE_DRAFT = "glide"  # the draft whose step a calibration record's draft_step_s holds

VerifyPoints = tuple[tuple[int, float], ...]  # (num_nodes, seconds), num_nodes increasing


@dataclass(frozen=True)
class DraftCost:
    """What one kind of draft costs on the host that runs it (seconds): a step, and a proposal's fixed
    part. Measured by the draft's host, combined with the serving target's verify curve."""

    step_s: float
    overhead_s: float = 0.0

    def with_verify(self, verify_points: VerifyPoints) -> CostModel:
        return CostModel(verify_points, self.step_s, self.overhead_s)


def verify_points_from_json(data: dict) -> VerifyPoints:
    """The target's verify curve in a calibration record (its draft costs, if any, are not read)."""
    try:
        points = tuple(sorted((int(n), float(s)) for n, s in data["verify_s"].items()))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InvalidArgument(f"not a verify cost calibration: {e}") from None
    return CostModel(points, draft_step_s=0.0).verify_points  # checked as a cost model checks them


def draft_costs_from_json(data: dict) -> dict[str, DraftCost]:
    """Every draft's costs in a calibration record: draft_step_s and draft_overhead_s are GliDe's,
    other_drafts the rest's; {} for a record of the target's curve alone."""
    try:
        costs = {
            str(kind): DraftCost(float(step), float(over))
            for kind, (step, over) in data.get("other_drafts", {}).items()
        }
        if "draft_step_s" in data:
            costs[GLIDE_DRAFT] = DraftCost(
                float(data["draft_step_s"]), float(data.get("draft_overhead_s", 0.0))
            )
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidArgument(f"not a draft cost calibration: {e}") from None
    return costs


def draft_costs_to_json(costs: dict[str, DraftCost]) -> dict:
    """The inverse of `draft_costs_from_json` (GliDe's in draft_step_s when measured)."""
    record: dict = {}
    glide = costs.get(GLIDE_DRAFT)
    if glide is not None:
        record.update(draft_step_s=glide.step_s, draft_overhead_s=glide.overhead_s)
    others = {kind: [c.step_s, c.overhead_s] for kind, c in costs.items() if kind != GLIDE_DRAFT}
    return {**record, **({"other_drafts": others} if others else {})}


@dataclass(frozen=True)
class BatchLoad:
    """What the rest of a batched forward holds besides this session's tree."""

    other_nodes: int = 0  # tree nodes of the other sessions in the same target forward
    other_expected: float = 0.0  # tokens the other sessions emit from that forward, in expectation

    def __post_init__(self) -> None:
        if self.other_nodes < 0 or self.other_expected < 0:
            raise InvalidArgument(f"a batch load cannot be negative: {self}")


ALONE = BatchLoad()

SMOOTHING = 0.8  # running means of rounds (tree sizes, acceptance) weigh the last few


def smoothed(mean: float, value: float) -> float:
    """A running mean moved towards the newest `value`."""
    return SMOOTHING * mean + (1 - SMOOTHING) * value


def load_like_this(others: int, mean_nodes: float, mean_emitted: float) -> BatchLoad:
    """The load of `others` sessions taken to send trees like this session's recent rounds (its running
    means of tree nodes, root included, and tokens emitted): the cost policy's and the suffix
    drafter's view of a batch."""
    if others <= 0:
        return ALONE
    return BatchLoad(round(others * mean_nodes), others * mean_emitted)


def default_calibration_name(model_name: str, device: str, dtype: str, kernel: str) -> str:
    """The file a calibration is saved under: costs hold for one model on one kind of device in one dtype
    and one linear kernel (on a 2-core AMD EPYC, docs/benchmarks.md, bf16's curve is flat where fp32's
    doubles from 1 to 2 nodes, and packed oneDNN weights flatten fp32's), so none is reused across."""
    return f"calibration-{model_name}-{device.replace(':', '')}-{dtype}-{kernel}.json"


# Used when no calibration is given: the shape section 7 of the algorithms notes reports for a CPU
# (16 tokens cost ~1.7x one token) and a draft step of 5% of a target forward. Only ratios matter: the
# decisions compare rates, so the unit cancels.
NOMINAL_CPU_COST = CostModel(((1, 1.0), (16, 1.7), (64, 4.0)), draft_step_s=0.05)


def expected_tokens(acceptances: Sequence[float], leaf_acceptances: Sequence[float] = ()) -> float:
    """E = 1 + sum_i P_{i-1} (a_i + L_i): acceptances [d] of the spine, leaf_acceptances [d] the summed
    leaf acceptance beside each spine token (missing = 0)."""
    expected, reach = 1.0, 1.0
    for i, a in enumerate(acceptances):
        leaves = leaf_acceptances[i] if i < len(leaf_acceptances) else 0.0
        expected += reach * (a + leaves)
        reach *= a
    return expected


def worth_extending(
    cost: CostModel,
    expected: float,  # E of the round so far
    reach: float,  # P_d: chance every spine token so far is accepted
    next_acceptance: float,  # predicted a of each further spine token
    num_spine: int,
    num_nodes: int,
    max_more: int,  # spine tokens the cap still allows
    load: BatchLoad = ALONE,
) -> bool:
    """Whether drafting 1..max_more further spine tokens can beat the batch's current rate."""
    return best_extension(cost, expected, reach, next_acceptance, num_spine, num_nodes, max_more, load) > 0


def best_extension(
    cost: CostModel,
    expected: float,  # E of the round so far
    reach: float,  # P_d: chance every spine token so far is accepted
    next_acceptance: float,  # predicted a of each further spine token
    num_spine: int,
    num_nodes: int,
    max_more: int,  # spine tokens the cap still allows
    load: BatchLoad = ALONE,
) -> int:
    """The count k in 0..max_more of further spine tokens whose round has the batch's highest expected
    rate (E + gain_k over the round's seconds with k more); 0 when none beats the round as it is. Every
    k is compared: a measured curve need not rise evenly, and one token may pay where two do not."""
    shared = num_nodes + load.other_nodes
    best_tokens, best_seconds = expected + load.other_expected, cost.round_s(num_spine, shared)
    best, gain, step_reach = 0, 0.0, reach
    for k in range(1, max_more + 1):
        step_reach *= next_acceptance
        gain += step_reach
        seconds = cost.round_s(num_spine + k, shared + k)
        tokens = expected + load.other_expected + gain
        if tokens * best_seconds > best_tokens * seconds:
            best, best_tokens, best_seconds = k, tokens, seconds
    return best


def leaves_worth_adding(
    cost: CostModel,
    expected: float,  # E of the round so far
    gains: Sequence[float],  # expected tokens each offered leaf adds, best first
    num_spine: int,
    num_nodes: int,
    load: BatchLoad = ALONE,
) -> int:
    """How many of the offered leaves to add: the count k whose round (E + g_1 + ... + g_k over one
    forward of num_nodes + k nodes) has the highest rate, 0 when none beats the current one.

    Every k is compared, not just the next leaf, because a measured curve need not rise: on the CPU of
    docs/benchmarks.md the target verifies 8 nodes faster than 7 (MKL picks another kernel), so a leaf
    that does not pay alone can pay together with the next."""
    shared = num_nodes + load.other_nodes
    total = expected + load.other_expected
    best_count, best_rate = 0, total / cost.round_s(num_spine, shared)
    for count, gain in enumerate(gains, start=1):
        total += gain
        rate = total / cost.round_s(num_spine, shared + count)
        if rate > best_rate:
            best_count, best_rate = count, rate
    return best_count
