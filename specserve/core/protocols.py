"""The two roles of the speculative loop. In-process and gRPC implementations both satisfy these.

A session's sampling parameters are fixed: drafters and verifiers are given them when they are made
(over gRPC: in each service's Prefill), so a round passes only what changes, the tokens and the round's
seed (core/rng.py derives it from the request seed and the position).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from specserve.core.tree import TokenTree, tree_children

if TYPE_CHECKING:  # torch stays out of the router, which runs the loop without it
    import torch


class CandidateKind(StrEnum):
    """How the draft chose the children of each node; decides the acceptance rule at T > 0."""

    FIXED = "fixed"
    SAMPLED = "sampled"
    SAMPLED_WITHOUT_REPLACEMENT = "sampled-without-replacement"


@dataclass(frozen=True)
class VerifyOutcome:
    """accepted_nodes: root first, the path whose KV is kept. next_token: the bonus (at a leaf) or
    recovered (after rejections) token.

    Target-initialised rounds (DraftTree.target_roots > 0) commit no next token: next_token is None and
    root_candidates holds the target's own candidates for that position (its top-W at T = 0, W samples
    without replacement from what it would have sampled at T > 0); the next round drafts under them.
    """

    accepted_nodes: list[int]
    next_token: int | None
    root_candidates: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftTree:
    """A proposal: the tree plus what the verifier needs to accept losslessly.

    draft_probs is only needed for sampled candidates (q of each internal node); fixed candidates
    (greedy drafts, top-k expansions) verify without it, so nothing vocabulary-sized has to travel.
    Each q is a [V] tensor. Over gRPC q travels sparse (specserve.v1.SparseProbs): the services convert
    at their edge (serving/tensor_convert.py), and the router, which has no torch, passes the draft's
    message to the target untouched (services/router/remote.py, WireDraftTree).
    """

    tree: TokenTree
    kind: CandidateKind = CandidateKind.FIXED
    draft_probs: Mapping[int, torch.Tensor] = field(default_factory=dict)  # node -> q [V]
    # Target-initialised MCSD (lossy at T > 0): W > 0 means node 0's children, if any, are the target's
    # root candidates from the previous round, judged by the longest-accepted-branch rule, and the
    # verifier answers with W candidates for the next position instead of a bonus token.
    target_roots: int = 0
    # Nodes proposed by the session's suffix index rather than a draft model (core/suffix_drafter.py):
    # they verify like any fixed candidate; the stats count their acceptances apart.
    suffix_nodes: frozenset[int] = frozenset()
    # Nodes a constraint's grammar forced (the only continuation it allows, core/grammar.py): fixed
    # candidates like the rest; the stats count them apart.
    forced_nodes: frozenset[int] = frozenset()

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls(TokenTree((root_token,), (-1,)))

    @property
    def num_seeded(self) -> int:
        """Nodes the target chose rather than the draft: the root candidates of a target-rooted tree."""
        return sum(1 for p in self.tree.parent_ids if p == 0) if self.target_roots else 0

    @property
    def num_draft_tokens(self) -> int:
        return self.tree.num_nodes - 1 - self.num_seeded


@dataclass(frozen=True)
class TargetReads:
    """What a drafter reads of the target's committed state: the K/V of some target layers (GliDe), its
    hidden states (a hidden-state draft, with the decoder layers they come from; () = the final one), or
    nothing. A draft replica subscribes to the target's feed for what is declared, and only then."""

    kv_layers: tuple[int, ...] = ()  # as configured: -1 is the last layer
    hidden_states: bool = False
    feature_layers: tuple[int, ...] = ()

    @property
    def anything(self) -> bool:
        return bool(self.kv_layers) or self.hidden_states


READS_NOTHING = TargetReads()


@dataclass(frozen=True)
class RoundOutcome:
    """A round's outcome, computed once: what was drafted, which path the target accepted, and what
    that means for each reader (the stats, the stop policy, the suffix index's trust, the router's
    metrics).

    The loop builds it from the verifier's answer (`RoundOutcome.of`) and hands it to the drafter's
    `observe` and to the caller's `on_round`. Where only tokens travel (a draft replica learns a round
    from the committed tokens of its next Propose), `RoundOutcome.from_committed` walks the tree along
    them; the walk is exact: a rejected child is never the token emitted at its depth (greedy emits the
    target's argmax, which differs; the sampled and fixed rules leave it no mass in the residual), so the
    walk stops where the accepted path did.
    """

    draft: DraftTree
    accepted_nodes: tuple[int, ...]  # root first: the path the target kept
    next_token: int | None  # the bonus or recovered token; None after a target-rooted round

    @classmethod
    def of(cls, draft: DraftTree, verified: VerifyOutcome) -> RoundOutcome:
        return cls(draft, tuple(verified.accepted_nodes), verified.next_token)

    @classmethod
    def from_committed(cls, draft: DraftTree, committed: Sequence[int]) -> RoundOutcome:
        """The round whose tokens committed after its root were `committed` (accepted path, then the
        bonus or recovered token when there is one)."""
        children = tree_children(draft.tree.parent_ids)
        path, node = [0], 0
        for token in committed:
            node = next((c for c in children[node] if draft.tree.token_ids[c] == token), -1)
            if node < 0:
                break
            path.append(node)
        rest = committed[len(path) - 1 :]
        return cls(draft, tuple(path), rest[0] if rest else None)

    @property
    def accepted_token_ids(self) -> list[int]:
        """Tokens of the accepted path, root excluded."""
        return [self.draft.tree.token_ids[i] for i in self.accepted_nodes[1:]]

    @property
    def emitted_token_ids(self) -> list[int]:
        """What the round commits: the accepted path, then the next token."""
        tokens = self.accepted_token_ids
        return tokens if self.next_token is None else [*tokens, self.next_token]

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens accepted: a target-rooted path starts with the target's own candidate."""
        return max(0, len(self.accepted_nodes) - 1 - min(1, self.draft.num_seeded))

    @property
    def num_suffix_draft_tokens(self) -> int:
        return len(self.draft.suffix_nodes)

    @property
    def num_suffix_accepted_tokens(self) -> int:
        return sum(1 for node in self.accepted_nodes if node in self.draft.suffix_nodes)

    @property
    def num_forced_draft_tokens(self) -> int:
        return len(self.draft.forced_nodes)

    @property
    def num_forced_accepted_tokens(self) -> int:
        return sum(1 for node in self.accepted_nodes if node in self.draft.forced_nodes)


class Drafter(Protocol):
    reads: TargetReads  # declared once, when the drafter is built

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        """token_ids: the whole committed sequence (prompt + generated); its last token is the root.
        round_seed: this round's draft seed (core/rng.py, draft_round_seed).
        batch_sessions: the sessions whose segments share this round's forwards, this one included
        (>= 1), as the loop's caller knows them; a drafter that sizes its trees by cost reads it."""
        ...

    def observe(self, outcome: RoundOutcome) -> None:
        """How the round this drafter proposed ended (RoundOutcome): what its stop policy and suffix
        index learn from. Called once per verified round, before the next `propose`."""
        ...

    def release(self) -> None: ...


@runtime_checkable
class KnowsPrompt(Protocol):
    """A drafter whose state is cacheable across requests only over the prompt (it reads the target's
    state, exact only there: runtime/prefix_cache.py, DraftBlocks); told the prompt's length before its
    first round."""

    def know_prompt(self, num_tokens: int) -> None: ...


@runtime_checkable
class RoundOpeningDrafter(Drafter, Protocol):
    """A drafter that can size a round before drafting it (runtime/drafter.py, PolicyDrafter)."""

    def open_round(self, token_ids: Sequence[int], batch_sessions: int) -> int:
        """Sizes the round rooted at token_ids[-1] beside batch_sessions - 1 other sessions; returns its
        cap in spine tokens (0 = the root alone). The `propose` that follows for the same tokens
        drafts under it."""
        ...


@runtime_checkable
class CostSizedDrafter(Drafter, Protocol):
    """What a draft service tells and asks a drafter whose rounds a cost policy may size
    (runtime/drafter.py, PolicyDrafter), without reaching into its policy. A drafter sized otherwise
    ignores what it is told and answers as if alone."""

    def charge_overhead(self, seconds: float) -> None:
        """What asking this drafter costs each round of its caller (the router's Propose round trip)."""
        ...

    def drafts_up_to(self, batch_sessions: int) -> int | None:
        """The largest batch, up to `batch_sessions`, at which its next round would draft; None when
        its rounds are sized as if alone (a sampled session, a policy without costs)."""
        ...

    def acceptance(self) -> tuple[float, int]:
        """(its smoothed acceptance estimate, rounds that drafted)."""
        ...

    def start_from(self, acceptance: float) -> None:
        """Starts a greedy session's acceptance estimate at a prior (a sampled one keeps its fixed
        start: its trees decide its random draws)."""
        ...


@runtime_checkable
class RootSeededDrafter(Drafter, Protocol):
    """A drafter of target-initialised MCSD: grows its tree under the target's root candidates."""

    def propose_from_roots(
        self, token_ids: Sequence[int], root_candidates: Sequence[int], round_seed: int, batch_sessions: int
    ) -> DraftTree:
        """root_candidates: the last VerifyOutcome's, for the position after token_ids."""
        ...


class Verifier(Protocol):
    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        """Computes the prompt's KV and returns the first generated token."""
        ...

    def resume(self, token_ids: Sequence[int]) -> None:
        """Continues a sequence whose tokens are already committed (the last one is the root)."""
        ...

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        """One target forward over the tree, acceptance, and commit of the accepted path's KV."""
        ...

    def release(self) -> None: ...


# Rounds a verifier may run on its own after the one it is given (AheadVerifier): a bound on how long a
# call stays away from the loop (and its client's stream), whatever a drafter would allow.
MAX_AHEAD_ROUNDS = 8


@dataclass(frozen=True)
class SuffixTrust:
    """What a suffix drafter (core/suffix_drafter.py) has learnt from the rounds it proposed, handed
    between the loop's drafter and a verifier's own for the rounds it runs ahead, so that one account
    sizes every round wherever it runs, as one drafter's does in process. `predicted` and
    `suffix_nodes` describe the proposal not yet observed (the tree sent with a plan): its expected
    accepted suffix tokens and which of its nodes are suffix candidates; None and empty once observed."""

    trust: float  # accepted suffix tokens against those predicted, a running ratio
    mean_nodes: float  # tree nodes a round (root included), a running mean
    mean_emitted: float  # tokens a round emits, a running mean
    predicted: float | None = None
    suffix_nodes: frozenset[int] = frozenset()

    MIN_TRUST: ClassVar[float] = 0.05
    MAX_TRUST: ClassVar[float] = 1.5

    def observed(self) -> SuffixTrust:
        """The account with nothing pending: what a verifier hands back once its rounds ran."""
        return SuffixTrust(self.trust, self.mean_nodes, self.mean_emitted)


@dataclass(frozen=True)
class AheadPlan:
    """Rounds after this one that a drafter would draft from suffix candidates alone (PlansAhead), and
    where the loop stands in skipping a drafter that proposed nothing (core/backoff.py, `skip_run` and
    `skip_left` as DraftBackoff has them): a round it would skip verifies the root alone there too, so
    the rounds are the loop's own, wherever they run. `total` bounds them all."""

    rounds: int  # rounds the drafter is asked, whatever their candidates
    copy_rounds: int = 0  # then rounds while each one's candidates expect `copy_tokens` or more
    copy_tokens: float = 0.0  # accepted tokens (where the drafter would not ask its model either)
    skip_run: int = 0  # DraftBackoff.run
    skip_left: int = 0  # DraftBackoff.left
    suffix: SuffixTrust | None = None  # the loop's suffix drafter as it stands (PlansAhead.suffix_trust)

    @property
    def total(self) -> int:
        return self.rounds + self.copy_rounds


@runtime_checkable
class AheadVerifier(Verifier, Protocol):
    """A verifier that can run rounds of its own after the one it is given: suffix candidates from the
    session's own text, drafted and verified where the target is (services/target), so a round that
    would not ask a draft model costs no round trip. Greedy, unconstrained sessions only."""

    ahead_limit: int  # rounds verify_ahead may run on its own after one (0: none, for this session)

    def verify_ahead(
        self, draft: DraftTree, round_seed: int, plan: AheadPlan, max_tokens: int
    ) -> list[tuple[DraftTree, VerifyOutcome]]:
        """`draft`'s outcome, then those of the rounds `plan` allows, each with the tree it verified;
        they stop once `max_tokens` tokens are committed (the first round's included) or an
        end-of-sequence token is."""
        ...

    def take_suffix_trust(self) -> SuffixTrust | None:
        """Once: the account the last verify_ahead's rounds left (from `plan.suffix`, with the plan's
        round and those that ran after it observed); None where the plan carried none."""
        ...


@runtime_checkable
class PlansAhead(Drafter, Protocol):
    """A drafter that knows when its next rounds would ask no draft model (core/suffix_drafter.py)."""

    def rounds_without_model(self, limit: int) -> AheadPlan:
        """The rounds after this one (at most `limit` in all) that would draft suffix candidates only."""
        ...

    def skip_rounds(self, count: int) -> None:
        """`count` of the plan's certain rounds ran elsewhere (a verifier ran them on its own): they
        count as rounds that did not ask the model."""
        ...

    def suffix_trust(self) -> SuffixTrust:
        """The suffix account as it stands, with the last proposal's prediction pending."""
        ...

    def adopt_trust(self, account: SuffixTrust) -> None:
        """Continues from `account` (a verifier's drafter's, after the rounds it ran ahead)."""
        ...
