"""Stop policies: how many tokens a drafter drafts in one round, behind one interface.

A drafter asks `max_depth` to size the spine, then after appending each spine token calls
`should_stop(step)`: True keeps that token and ends the round (SVIP's rule: the uncertain token is
still worth verifying, and deciding after appending wastes no draft forward). After verification the
loop calls `observe(num_drafted, num_accepted)` so adaptive policies can learn. A policy that sizes a
round from state outside the drafter (the cost policy: the batch) is a `RoundPolicy`: the drafter calls
its `start_round(batch_sessions)` once per round, after `observe`, with the number of sessions that share
the round's forwards as the loop passed it, and `max_depth` then answers for that round.

Policies:
- fixed: always `fixed_depth` tokens.
- svip (arXiv 2411.18462): stop once sqrt(c * H) > h, H the entropy (nats) of the distribution the
  token was drawn from. Official c = 0.15, h = 0.3, i.e. stop after a token with H > 0.6 nats.
- adaedl (arXiv 2410.18351): stop once 1 - sqrt(factor * H) < lambda, with lambda adapted online toward
  a target acceptance rate (the update of Draft & Verify, which AdaEDL reuses).
- decision (improved MCSD, arXiv 2409.10644): a small MLP (core/decision.py) predicts from the draft
  distribution whether the token will be accepted; stop once the prediction is <= 0.4. Weights come from
  `specserve train-stopper` (shipped for the default model); specserve.runtime.stopper loads them into
  StopSettings.decision_model (this module does no I/O).
- cost (ours, core/cost.py): keep drafting, and with CaPE keep adding leaves, only while the expected
  tokens per second of the round rise, given this machine's calibrated costs and predicted acceptances.

Worked example, SVIP with the official settings. Spine distributions with entropies 0.10, 0.35, 0.69
(uniform over two tokens: ln 2) and 0.20 nats: the first two continue, the third is kept and stops
the round, so 3 tokens are verified.

A policy object holds online state: use one per request. Adding a policy = one `StopPolicyName` member
(core/stop_names.py, torch-free: the method catalog names policies too) + one `STOP_POLICIES` entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch

from specserve.core.cost import (
    ALONE,
    NOMINAL_CPU_COST,
    BatchLoad,
    CostModel,
    best_extension,
    leaves_worth_adding,
    load_like_this,
    smoothed,
    worth_extending,
)
from specserve.core.decision import DecisionModel
from specserve.core.stop_names import StopPolicyName
from specserve.errors import InvalidArgument


class AcceptanceEstimate(StrEnum):
    """Where the cost policy's per-token acceptance a_i comes from."""

    DECISION = "decision"  # the learned stopper's prediction, corrected to the real acceptance rate
    CONFIDENCE = "confidence"  # the draft's own probability of the token (T = 1)


SVIP_MAX_DEPTH = 40  # official SVIP cap; no minimum
ADAEDL_MAX_DEPTH = 40  # no official value: SVIP's, since SVIP is AdaEDL with a fixed lambda
DECISION_MAX_DEPTH = 20  # SpecDec++'s upper bound for its learned stopper
COST_MAX_DEPTH = 16  # the cost curve decides; a cap keeps a mis-predicted streak bounded


@dataclass(frozen=True)
class StopSettings:
    """Every stop policy's parameters; each policy reads only its own.

    max_depth caps the tokens drafted per round. None means the policy's own default cap: fixed_depth
    for fixed, 40 for svip and adaedl, 20 for decision, 16 for cost.
    """

    max_depth: int | None = None
    fixed_depth: int = 4
    svip_c: float = 0.15
    svip_h: float = 0.3
    adaedl_factor: float = 0.2
    adaedl_initial_lambda: float = 0.7  # SVIP's h = 0.3 expressed as a lambda (1 - 0.3)
    adaedl_target_acceptance: float = 0.9  # Draft & Verify's target, whose update AdaEDL reuses
    adaedl_step: float = 0.01  # lambda's proposed move per round, before smoothing
    adaedl_lambda_smoothing: float = 0.9  # lambda = 0.9 lambda + 0.1 (lambda +- step)
    adaedl_acceptance_smoothing: float = 0.5  # rate = 0.5 rate + 0.5 accepted / drafted
    decision_threshold: float = 0.4  # the paper's: stop once the predicted acceptance is <= 0.4
    decision_model: DecisionModel | None = None  # the learned stopper (specserve.runtime.stopper loads it)
    cost_model: CostModel | None = None  # calibrated costs; None = NOMINAL_CPU_COST (ratios only)
    cost_acceptance: AcceptanceEstimate = AcceptanceEstimate.DECISION

    def __post_init__(self) -> None:
        if self.max_depth is not None and self.max_depth < 1:
            raise InvalidArgument(f"max_depth must be >= 1 or None, got {self.max_depth}")
        if self.fixed_depth < 1:
            raise InvalidArgument(f"fixed_depth must be >= 1, got {self.fixed_depth}")
        if self.svip_c <= 0 or self.svip_h < 0 or self.adaedl_factor <= 0:
            raise InvalidArgument("svip_c and adaedl_factor must be > 0, svip_h >= 0")
        for name in (
            "adaedl_initial_lambda",
            "adaedl_target_acceptance",
            "decision_threshold",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InvalidArgument(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("adaedl_lambda_smoothing", "adaedl_acceptance_smoothing"):  # 1 would never move
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InvalidArgument(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adaedl_step < 0:
            raise InvalidArgument(f"adaedl_step must be >= 0, got {self.adaedl_step}")
        if self.cost_acceptance not in tuple(AcceptanceEstimate):
            raise InvalidArgument(f"cost_acceptance must be one of {', '.join(AcceptanceEstimate)}")

    def cap(self, default: int) -> int:
        """The round's token cap: max_depth when set, else the policy's default."""
        return default if self.max_depth is None else self.max_depth

    def require_decision_model(self) -> DecisionModel:
        if self.decision_model is None:
            raise InvalidArgument(
                "this stop policy needs the learned stopper: set StopSettings.decision_model "
                "(specserve.runtime.stopper.make_stop_policy loads the shipped one)"
            )
        return self.decision_model


# A drafted token carries tensors, which have no single truth value: compare steps by identity.
@dataclass(frozen=True, eq=False)
class DraftStep:
    depth_index: int  # 0-based position of the token on the spine
    logits: torch.Tensor  # [V] raw draft logits of the distribution the token was drawn from
    token: int  # the chosen (kept) token id


def entropy_nats(logits: torch.Tensor) -> float:
    """logits: [V] -> entropy of softmax(logits) at T = 1 in nats; -inf entries contribute 0."""
    logits = logits.double()
    if not torch.isfinite(logits).any():
        raise InvalidArgument("logits need at least one finite entry")
    log_probs = torch.log_softmax(logits, dim=-1)  # [V]
    probs = log_probs.exp()
    # p log p -> 0 as p -> 0; written out because 0 * -inf is nan
    return float(-torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum())


def svip_stops(entropy: float, c: float, h: float) -> bool:
    """SVIP: the acceptance estimate 1 - sqrt(c H) has fallen below 1 - h."""
    return math.sqrt(c * entropy) > h


def adaedl_stops(entropy: float, factor: float, lam: float) -> bool:
    """AdaEDL: the entropy lower bound on acceptance, 1 - sqrt(factor H), is below lambda."""
    return 1.0 - math.sqrt(factor * entropy) < lam


def smoothed_acceptance(rate: float | None, num_drafted: int, num_accepted: int, smoothing: float) -> float:
    """Exponential average of accepted / drafted.

    The first round (rate None) is taken as it is: Draft & Verify starts from 0, which reads the first
    rounds as poor acceptance and nudges lambda up before there is any evidence.
    """
    observed = num_accepted / num_drafted
    return observed if rate is None else smoothing * rate + (1.0 - smoothing) * observed


def adaedl_lambda(lam: float, rate: float, target: float, step: float, smoothing: float) -> float:
    """Moves lambda one smoothed step: up (stop sooner) while acceptance is at or below the target.

    Clamped to [0, 1]: the bound 1 - sqrt(f H) never exceeds 1, so a lambda past 1 cannot stop any more
    often and would only take longer to come back once acceptance recovers.
    """
    proposed = lam + step if rate <= target else lam - step
    return min(1.0, max(0.0, smoothing * lam + (1.0 - smoothing) * proposed))


class StopPolicy(Protocol):
    @property
    def max_depth(self) -> int:
        """Most tokens the next round may draft; drafters size the spine with it."""
        ...

    def should_stop(self, step: DraftStep) -> bool:
        """Called after `step.token` is appended, once per spine token in order: True keeps it and
        ends the round."""
        ...

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """After verification: spine tokens drafted this round and how many of them were accepted
        (the bonus token not counted)."""
        ...


@runtime_checkable
class RoundPolicy(Protocol):
    """A stop policy whose cap depends on more than its own history (the cost policy: the batch)."""

    def start_round(self, batch_sessions: int) -> int:
        """Called once per round, after `observe` of the last one, with the sessions whose segments
        share the round's forwards (this one included, >= 1): decides this round's cap, which
        `max_depth` then returns until the next call. Returns it."""
        ...


@runtime_checkable
class WidthPolicy(Protocol):
    """A stop policy that also trims the candidates at each depth (the cost policy with CaPE)."""

    def choose_width(self, depth_index: int, logits: torch.Tensor, width: int) -> int:
        """Called before the candidates at `depth_index` are picked, with the drafter's width (>= 1);
        returns a width in 1..width. `should_stop` for the same depth follows."""
        ...


def check_round(num_drafted: int, num_accepted: int) -> None:
    if not 0 <= num_accepted <= num_drafted:
        raise InvalidArgument(f"need 0 <= accepted <= drafted, got {num_accepted} of {num_drafted}")


class FixedPolicy:
    def __init__(self, settings: StopSettings) -> None:
        self._max_depth = min(settings.fixed_depth, settings.cap(settings.fixed_depth))

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def should_stop(self, step: DraftStep) -> bool:
        return False  # the spine ends at max_depth

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        check_round(num_drafted, num_accepted)


class SvipPolicy:
    def __init__(self, settings: StopSettings) -> None:
        self._max_depth = settings.cap(SVIP_MAX_DEPTH)
        self.c, self.h = settings.svip_c, settings.svip_h

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def should_stop(self, step: DraftStep) -> bool:
        return svip_stops(entropy_nats(step.logits), self.c, self.h)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        check_round(num_drafted, num_accepted)


class AdaEdlPolicy:
    def __init__(self, settings: StopSettings) -> None:
        self._max_depth = settings.cap(ADAEDL_MAX_DEPTH)
        self.settings = settings
        self.lam = settings.adaedl_initial_lambda
        self.acceptance_rate: float | None = None  # smoothed accepted / drafted; None before any round

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def should_stop(self, step: DraftStep) -> bool:
        return adaedl_stops(entropy_nats(step.logits), self.settings.adaedl_factor, self.lam)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        check_round(num_drafted, num_accepted)
        if num_drafted == 0:
            return  # nothing was drafted: no evidence either way
        s = self.settings
        self.acceptance_rate = smoothed_acceptance(
            self.acceptance_rate, num_drafted, num_accepted, s.adaedl_acceptance_smoothing
        )
        self.lam = adaedl_lambda(
            self.lam,
            self.acceptance_rate,
            s.adaedl_target_acceptance,
            s.adaedl_step,
            s.adaedl_lambda_smoothing,
        )


class DecisionPolicy:
    """Stops once the learned stopper's predicted acceptance of the drafted token is <= the threshold."""

    def __init__(self, settings: StopSettings) -> None:
        self._max_depth = settings.cap(DECISION_MAX_DEPTH)
        self.threshold = settings.decision_threshold
        self.model = settings.require_decision_model()

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def should_stop(self, step: DraftStep) -> bool:
        return self.model.acceptance(step.logits) <= self.threshold

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        check_round(num_drafted, num_accepted)


def prior_corrected(probability: float, positive_rate: float) -> float:
    """A prediction of a model trained on balanced classes, moved to the real base rate: the odds are
    multiplied by positive_rate / (1 - positive_rate). A rate of 0.5 leaves it unchanged."""
    if probability >= 1.0 or positive_rate >= 1.0:
        return 1.0
    if probability <= 0.0 or positive_rate <= 0.0:
        return 0.0
    odds = probability / (1.0 - probability) * positive_rate / (1.0 - positive_rate)
    return odds / (1.0 + odds)


# The session's acceptance rate, which decides whether a round drafts at all, is a posterior mean over
# its recent rounds: a prior worth PRIOR_TOKENS drafted tokens plus the session's drafted and accepted
# tokens, each round's counts weighing EVIDENCE_DECAY less with every round sized since. Evidence must
# age: a rate below the bar stops the drafting that would measure it again, so a plain running mean of
# drafting rounds, once a few rejections had pushed it under, never moved again and the session never
# drafted again (on a fast host, where the bar is higher, the default method fell to plain decoding).
# Aged, the estimate drifts back towards the prior while nothing is drafted, and a later round probes.
PRIOR_TOKENS = 2.0
EVIDENCE_DECAY = 0.9  # about ten rounds of memory


class CostPolicy:
    """Grows a round while it raises the expected tokens per second (core/cost.py has the model).

    Round state is reset at depth 0. Each spine token adds P a to E and one node; with CaPE,
    `choose_width` keeps as many of the top leaves as give the round its highest expected rate. A leaf's
    acceptance is its draft probability scaled like the spine token's (a_leaf = q_leaf a_spine /
    q_spine): the predictor judges the spine token, the draft ranks the rest.
    """

    def __init__(self, settings: StopSettings) -> None:
        self._max_depth = settings.cap(COST_MAX_DEPTH)
        self._round_cap = self._max_depth  # this round's (start_round)
        self.cost = settings.cost_model if settings.cost_model is not None else NOMINAL_CPU_COST
        # Batches (start_round's batch_sessions): the other sessions are assumed to send trees like this
        # session's recent ones.
        # Running means. Other sessions start out assumed to send the root alone: assuming bigger trees
        # makes the forward look expensive already, and a calibrated curve with a dip (16 nodes cheaper
        # than 13 on the CPU of docs/benchmarks.md) then makes drafting look free.
        self.mean_nodes, self.mean_emitted = 1.0, 1.0
        self.prior_acceptance = 0.5  # before the session's own rounds say otherwise (mean_acceptance)
        self._drafted_evidence = self._accepted_evidence = 0.0  # aged token counts (EVIDENCE_DECAY)
        self.num_drafting_rounds = 0  # rounds observed with draft tokens: what mean_acceptance rests on
        self.load = ALONE
        # Sized by the batch only under greedy decoding, where trees never change the output. With
        # sampling the tokens drawn depend on the tree, so a seeded request must get the same trees
        # whatever else runs: its trees are sized as if alone.
        self.batch_aware = True
        # What asking the drafter costs a round beyond the drafter's own work (its calibrated fixed cost
        # and its steps, which the cost model holds): the transport and waits of the caller's call, as
        # the caller measures it (the router's Propose round trip less the draft's handler time, plus
        # the handler's wait for the KV feed). It depends on timing, so like the load only greedy rounds
        # use it.
        self.transport_s = 0.0
        self._sizes_counted = False  # the round being observed was counted already (a cap of 0)
        self.estimate = AcceptanceEstimate(settings.cost_acceptance)
        self.model = (
            settings.require_decision_model() if self.estimate is AcceptanceEstimate.DECISION else None
        )
        self._reset()

    def _reset(self) -> None:
        self.expected, self.reach = 1.0, 1.0  # E so far, P_d
        self.num_spine, self.num_nodes = 0, 1  # the root is node 0
        self.last_acceptance = 0.0
        self._width_depth = -1  # the depth `choose_width` already accounted for

    def _round_cost(self) -> CostModel:
        if self.batch_aware and self.transport_s > 0:
            return replace(self.cost, draft_overhead_s=self.cost.draft_overhead_s + self.transport_s)
        return self.cost

    @property
    def max_depth(self) -> int:
        """This round's cap, as `start_round` decided it."""
        return self._round_cap

    @property
    def mean_acceptance(self) -> float:
        """The session's acceptance rate of drafted spine tokens: the prior and the aged evidence."""
        drafted = PRIOR_TOKENS + self._drafted_evidence
        return (PRIOR_TOKENS * self.prior_acceptance + self._accepted_evidence) / drafted

    @mean_acceptance.setter
    def mean_acceptance(self, rate: float) -> None:
        """Starts the estimate over from `rate` (e.g. what the draft service's earlier sessions showed)."""
        if not 0.0 <= rate <= 1.0:
            raise InvalidArgument(f"an acceptance rate must be in [0, 1], got {rate}")
        self.prior_acceptance = rate
        self._drafted_evidence = self._accepted_evidence = 0.0

    def start_round(self, batch_sessions: int) -> int:
        """0 when, beside batch_sessions - 1 other sessions and with the cost of asking the drafter,
        not even one more token with the session's recent acceptance rate is worth it; else the
        policy's cap."""
        if batch_sessions < 1:
            raise InvalidArgument(f"batch_sessions counts this session too: >= 1, got {batch_sessions}")
        self.load = self._load_beside(batch_sessions - 1)
        self._drafted_evidence *= EVIDENCE_DECAY  # one round older, whether or not it drafts
        self._accepted_evidence *= EVIDENCE_DECAY
        self._sizes_counted = False
        self._round_cap = self._cap_under(self.load)
        if self._round_cap == 0:
            self._reset()  # a round of the root alone: one node, nothing drafted
            self._update_sizes(1, 1)  # counted now: rounds the loop then skips send the root alone too
            self._sizes_counted = True
        return self._round_cap

    def _cap_under(self, load: BatchLoad) -> int:
        """This round's cap at `load`: the policy's own where a drafted token pays, else 0."""
        return self._max_depth if self._drafts_under(load) else 0

    def largest_drafting_batch(self, batch_sessions: int) -> int:
        """After a round of the root alone beside batch_sessions - 1 others: the largest n such that the
        next round would draft at every load of 1..n sessions (this one included), by the policy's
        estimates as they stand; 0 = not even alone.

        Scanned upwards from one session, not bisected: a measured verify curve can dip (on a 2-core AMD
        EPYC Zen 3, oneDNN verifies 9-13 nodes faster than 8), so a token can pay again at a larger batch
        after it stopped paying. The contiguous range from one session is what a caller may rely on
        (the router skips asking the draft above it), and it is the same whatever `batch_sessions` bounds
        the scan. It costs one evaluation per session it passes, the first that fails included."""
        sessions = 0
        while sessions < batch_sessions - 1 and self._drafts_under(self._load_beside(sessions)):
            sessions += 1
        return sessions

    def _drafts_under(self, load: BatchLoad) -> bool:
        """Whether one token at the recent acceptance rate beats the rate of the root alone."""
        # Alone too, and with no fixed cost measured: the first token's step is paid before `should_stop`
        # can weigh it, and a draft step of half a target step (a hidden-state draft beside a 4-bit
        # target on a CPU) at 20-40% acceptance loses to plain decoding.
        return worth_extending(
            self._round_cost(), 1.0, 1.0, self.mean_acceptance, 0, 1, self._max_depth, load
        )

    def _load_beside(self, others: int) -> BatchLoad:
        if not self.batch_aware:
            return ALONE
        return load_like_this(others, self.mean_nodes, self.mean_emitted)

    def acceptance(self, logits: torch.Tensor, token: int | None) -> float:
        """Predicted a of a drafted token (None = the draft's top token)."""
        if self.model is not None:
            return prior_corrected(self.model.acceptance(logits), self.model.positive_rate)
        probs = torch.softmax(logits.double(), dim=-1)  # [V]
        return float(probs.max() if token is None else probs[token])

    def _add_spine(self, depth_index: int, acceptance: float) -> None:
        if depth_index == 0:
            self._reset()
        self.expected += self.reach * acceptance
        self.num_spine += 1
        self.num_nodes += 1
        self.last_acceptance = acceptance

    def choose_width(self, depth_index: int, logits: torch.Tensor, width: int) -> int:
        spine = self.acceptance(logits, None)
        reach_before = 1.0 if depth_index == 0 else self.reach
        self._add_spine(depth_index, spine)
        self._width_depth = depth_index
        kept = 1
        if width > 1:
            top = torch.topk(torch.softmax(logits.double(), dim=-1), width).values.tolist()  # [width]
            scale = spine / top[0] if top[0] > 0 else 0.0
            gains = [reach_before * min(1.0, q * scale) for q in top[1:]]  # [width - 1]
            leaves = leaves_worth_adding(
                self._round_cost(), self.expected, gains, self.num_spine, self.num_nodes, self.load
            )
            self.expected += sum(gains[:leaves])
            self.num_nodes += leaves
            kept += leaves
        self.reach = reach_before * spine
        return kept

    def should_stop(self, step: DraftStep) -> bool:
        if self._width_depth != step.depth_index:  # no choose_width call (a chain): account for it here
            reach_before = 1.0 if step.depth_index == 0 else self.reach
            acceptance = self.acceptance(step.logits, step.token)
            self._add_spine(step.depth_index, acceptance)
            self.reach = reach_before * acceptance
        self._width_depth = -1
        more = self._max_depth - self.num_spine
        return not worth_extending(
            self._round_cost(),
            self.expected,
            self.reach,
            self.last_acceptance,
            self.num_spine,
            self.num_nodes,
            more,
            self.load,
        )

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        check_round(num_drafted, num_accepted)
        if not self._sizes_counted:  # a round of the root alone is counted when start_round chooses it
            self._update_sizes(self.num_nodes, num_accepted + 1)
        self._sizes_counted = False
        if num_drafted:
            self._drafted_evidence += num_drafted
            self._accepted_evidence += num_accepted
            self.num_drafting_rounds += 1

    def _update_sizes(self, num_nodes: int, num_emitted: int) -> None:
        self.mean_nodes = smoothed(self.mean_nodes, num_nodes)
        self.mean_emitted = smoothed(self.mean_emitted, num_emitted)


class GatedPolicy(CostPolicy):
    """A fixed tree, gated: each round drafts the depth k in 1..d (at the tree's own widths) whose round
    earns the most where the cost policy's round gate opens (k tokens at the session's acceptance rate
    beat the root alone at this load, the batch and the transport priced in; the router skips the draft
    above `largest_drafting_batch`), else the root alone; no per-token choices. Where one token pays and
    two do not (a 4-bit 1.5B target on 2 AVX2 cores verified 3 tokens at 1.49 one-token steps, 2 at
    1.16, beside a draft step of 0.32), a round of the whole depth would lose what the gate promised.

    Under the cost policy a draft whose own probabilities understate how often the target agrees stops
    its rounds early: Qwen2.5-Coder-1.5B's 0.5B sibling ran 0.97-1.19x `target` with it, 1.10-1.28x as
    a fixed chain of 2 (docs/benchmarks.md). The rate the gate reads is the per-token acceptance a
    chain shows: accepted tokens over accepted tokens plus rounds that stopped short (a geometric run's
    estimate; accepted over drafted would read 0.62 for a chain of 2 accepted at 0.71 and 0.76), the
    prior's PRIOR_TOKENS split alike, all aged as the cost policy ages its evidence.
    """

    def __init__(self, settings: StopSettings) -> None:
        super().__init__(replace(settings, cost_acceptance=AcceptanceEstimate.CONFIDENCE))
        self._max_depth = self._round_cap = settings.cap(settings.fixed_depth)
        self._stopped_evidence = 0.0  # aged count of drafting rounds that stopped short

    @property
    def mean_acceptance(self) -> float:
        accepted = PRIOR_TOKENS * self.prior_acceptance + self._accepted_evidence
        return accepted / (PRIOR_TOKENS + self._accepted_evidence + self._stopped_evidence)

    @mean_acceptance.setter
    def mean_acceptance(self, rate: float) -> None:
        CostPolicy.mean_acceptance.fset(self, rate)  # type: ignore[attr-defined]
        self._stopped_evidence = 0.0

    def start_round(self, batch_sessions: int) -> int:
        self._stopped_evidence *= EVIDENCE_DECAY
        return super().start_round(batch_sessions)

    def _cap_under(self, load: BatchLoad) -> int:
        """The depth whose round earns most at `load`, 0 where none beats the root alone."""
        return best_extension(self._round_cost(), 1.0, 1.0, self.mean_acceptance, 0, 1, self._max_depth, load)

    def _count_spine(self, depth_index: int, width: int = 1) -> None:
        """The round's sizes (what `observe` records for the batch): a spine token and its leaves."""
        if depth_index == 0:
            self._reset()
        self.num_spine += 1
        self.num_nodes += width
        self._width_depth = depth_index

    def choose_width(self, depth_index: int, logits: torch.Tensor, width: int) -> int:
        self._count_spine(depth_index, width)
        return width  # the tree's own width (CaPE's, top-2's): no per-token choices

    def should_stop(self, step: DraftStep) -> bool:
        if self._width_depth != step.depth_index:
            self._count_spine(step.depth_index)
        self._width_depth = -1
        return False  # the spine ends at the round's cap

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        super().observe(num_drafted, num_accepted)
        if num_accepted < num_drafted:
            self._stopped_evidence += 1


STOP_POLICIES: dict[StopPolicyName, Callable[[StopSettings], StopPolicy]] = {
    StopPolicyName.FIXED: FixedPolicy,
    StopPolicyName.SVIP: SvipPolicy,
    StopPolicyName.ADAEDL: AdaEdlPolicy,
    StopPolicyName.DECISION: DecisionPolicy,
    StopPolicyName.COST: CostPolicy,
    StopPolicyName.GATED: GatedPolicy,
}


def _policy_name(name: str | StopPolicyName) -> StopPolicyName:
    if name not in STOP_POLICIES:  # a StrEnum member equals its value
        valid = ", ".join(STOP_POLICIES)
        raise InvalidArgument(f"unknown stop policy {name!r}; valid: {valid}")
    return StopPolicyName(name)


def needs_decision_model(name: str | StopPolicyName, settings: StopSettings) -> bool:
    """Whether policy `name` with `settings` reads the learned stopper (StopSettings.decision_model)."""
    key = _policy_name(name)
    return key is StopPolicyName.DECISION or (
        key is StopPolicyName.COST
        and AcceptanceEstimate(settings.cost_acceptance) is AcceptanceEstimate.DECISION
    )


def make_stop_policy(name: str | StopPolicyName, settings: StopSettings | None = None) -> StopPolicy:
    """A fresh policy (fresh online state) for `name`, e.g. make_stop_policy("svip"). Policies that read
    the learned stopper need settings.decision_model (specserve.runtime.stopper fills in the shipped one)."""
    return STOP_POLICIES[_policy_name(name)](settings if settings is not None else StopSettings())
