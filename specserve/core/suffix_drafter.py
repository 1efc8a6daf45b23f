"""Suffix candidates that cost nothing, merged with a model draft's tree under the cost policy.

Each round, the longest suffix of the session's own text (prompt + committed tokens) that occurred
before proposes what followed it then (core/suffix.py: a trie of continuations scored by how often each
followed). Those candidates are deterministic proposals (one-hot draft distributions), so they verify
with the fixed-candidate rule (core/verify.py): greedy output stays the target's own and sampling keeps
the target's distribution, whatever they propose.

How a round is built (`SuffixDrafter.propose`):
1. The suffix trie is ranked best-first by score s_i (the share of earlier occurrences that continued
   through node i, i.e. a prediction of P(node i's path is accepted)), discounted by `trust`, the
   session's running ratio of suffix tokens accepted to tokens predicted.
2. Its size is chosen by expected tokens per second on this machine's calibrated verify curve (the same
   rule as core/cost.py): k nodes emit E_k = 1 + trust * (s_1 + ... + s_k) tokens for verify_s(1 + k),
   and the k with the highest E_k / verify_s is taken, sharing the forward with the other sessions of a
   batch when there are any. Those are assumed to send trees like this session's recent rounds (the
   cost policy's assumption, core/stopping.py) rather than the root alone, which priced every node as if
   the others added none. (Measured at 4 and 16 sessions in process, this trims a few nodes a forward and
   moves throughput within noise: docs/benchmarks.md, "An AVX2-only host".)
3. When those candidates alone already expect `model_skip_tokens` accepted tokens or more, the round is
   suffix-only: the model drafter is not asked (no draft forward in process, no Propose call through the
   stack). Otherwise the model drafter proposes its own tree and the suffix candidates are merged into it
   (shared prefixes once), within `max_nodes`.
4. A greedy session also weighs what the model's drafts have earned against what they cost, both
   measured in the session (`ModelWorth`): where the tokens it adds per call take less time to decode
   than the call takes, it is asked only now and then (1, 2, 4 ... up to 8 rounds apart) to see whether
   that changed. Under a JSON schema, say, its drafts add little to the copies and the forced text.
Model drafts of sampled kind (candidates drawn from q at T > 0) follow another acceptance rule and are
never mixed with fixed candidates: such a round takes the model's tree when it drafted, else the suffix's.

Pure Python (no torch): the router, which imports no torch, runs it in front of the remote draft.
`suffix_drafter` is the one place a session's SuffixDrafter is assembled, in process (specserve/methods.py)
and in the router (services/router/session_run.py) alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.core.backoff import DraftBackoff
from specserve.core.cost import CostModel, load_like_this, smoothed
from specserve.core.grammar import ConstrainedDrafter, GrammarState
from specserve.core.prompt_indexes import TenantPrompts
from specserve.core.protocols import (
    READS_NOTHING,
    AheadPlan,
    CandidateKind,
    Drafter,
    DraftTree,
    KnowsPrompt,
    RoundOpeningDrafter,
    RoundOutcome,
    SuffixTrust,
    TargetReads,
)
from specserve.core.sampling_params import SamplingParams
from specserve.core.suffix import SharedSuffixCache, SuffixIndex, SuffixProposal, merge_proposals
from specserve.core.text_suffix import TextCodec, TextSuffixIndex
from specserve.core.tree import TokenTree
from specserve.errors import InvalidArgument

# A session's index keeps its most recent tokens only (about 1.5 KB each: ~12 MB at most per session).
INDEX_WINDOW_TOKENS = 8192
HEAD_TOKENS = 64  # tokens compared to tell a continued sequence from another one


@dataclass(frozen=True)
class SuffixSettings:
    max_depth: int = 8  # tokens a suffix candidate path may run ahead
    max_nodes: int = 24  # suffix candidates per round (the merged tree also obeys max_tree_nodes)
    min_score: float = 0.1  # candidates fewer than this share of the occurrences followed are dropped
    max_match: int = 8  # longest suffix looked up
    model_skip_tokens: float = 1.0  # expected accepted suffix tokens at which the model is not asked
    initial_trust: float = 0.7  # before any round was verified
    trust_smoothing: float = 0.2  # weight of the last round in the running trust

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_nodes < 1 or self.max_match < 1:
            raise InvalidArgument("suffix max_depth, max_nodes and max_match must be >= 1")
        if not 0.0 <= self.min_score <= 1.0 or not 0.0 < self.trust_smoothing <= 1.0:
            raise InvalidArgument("suffix min_score must be in [0, 1] and trust_smoothing in (0, 1]")
        # the range trust keeps and a target accepts it in (a session's account travels: SuffixTrust)
        if not SuffixTrust.MIN_TRUST <= self.initial_trust <= SuffixTrust.MAX_TRUST:
            raise InvalidArgument(
                f"suffix initial_trust must be in [{SuffixTrust.MIN_TRUST}, {SuffixTrust.MAX_TRUST}]"
            )


@dataclass
class ModelWorth:
    """A session's account of its model drafter: the tokens it added per call (accepted model tokens),
    the seconds a call took, and the session's seconds per generated token, as running means. The
    model pays while its tokens would take longer to decode than its call takes."""

    gain: float = 1.0  # accepted model tokens per call (optimistic until measured)
    call_s: float | None = None  # None until a call was timed
    token_s: float | None = None
    explore: DraftBackoff = field(default_factory=DraftBackoff)  # asked now and then while it does not pay
    clock: Callable[[], float] = time.perf_counter  # seconds (WorthPriors gives its own)
    _last: tuple[float, int] | None = None  # (time, tokens) when a round was last proposed

    def round_starts(self, num_tokens: int) -> None:
        now = self.clock()
        if self._last is not None and num_tokens > self._last[1]:
            per_token = (now - self._last[0]) / (num_tokens - self._last[1])
            self.token_s = per_token if self.token_s is None else smoothed(self.token_s, per_token)
        self._last = (now, num_tokens)

    def pays(self) -> bool:
        return self.token_s is None or self.call_s is None or self.gain * self.token_s >= self.call_s

    def should_ask(self) -> bool:
        return self.pays() or self.explore.should_ask()

    def called(self, seconds: float) -> None:
        self.call_s = seconds if self.call_s is None else smoothed(self.call_s, seconds)

    def observe(self, accepted_model_tokens: int) -> None:
        self.gain = smoothed(self.gain, accepted_model_tokens)
        self.explore.observe(int(self.pays()))


class WorthPriors:
    """What the model drafts earned in a process's earlier sessions, per kind of session (`key`: the draft,
    and whether a grammar constrains the session): a session starts from it rather than from an
    optimistic guess. Where the model did not pay, a new session asks it first after `max_skip` rounds
    instead of on its first round, whose call also carries the prompt's catch-up (under a JSON schema,
    the one call most sessions would make). Numbers only: no text of any session."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, float, float]] = {}  # gain, call_s, token_s
        self.clock = clock  # what its sessions time their rounds and calls with (seconds)

    def start(self, key: str) -> ModelWorth:
        with self._lock:
            known = self._known.get(key)
        if known is None:
            return ModelWorth(clock=self.clock)
        worth = ModelWorth(gain=known[0], call_s=known[1], token_s=known[2], clock=self.clock)
        if not worth.pays():
            worth.explore.hold_off()
        return worth

    def record(self, key: str, worth: ModelWorth) -> None:
        if worth.token_s is not None and worth.call_s is not None:
            with self._lock:
                self._known[key] = (worth.gain, worth.call_s, worth.token_s)


@dataclass(frozen=True)
class WorthBook:
    """Where a session's account of its model is started from and recorded (`WorthPriors`), under which
    draft's name."""

    priors: WorthPriors
    draft: str

    def key(self, constrained: bool) -> str:
        return f"{self.draft}:constrained" if constrained else self.draft


@dataclass(frozen=True)
class TenantCache:
    """The shared cache of recent outputs and the tenant whose outputs this session may draft from."""

    cache: SharedSuffixCache
    tenant: str


class SuffixDrafter:
    """A Drafter: suffix candidates alone (`inner` None) or merged with a model drafter's trees."""

    def __init__(
        self,
        inner: Drafter | None,
        max_tree_nodes: int,
        cost: CostModel | None = None,
        settings: SuffixSettings = SuffixSettings(),
        shared: TenantCache | None = None,
        batch_aware: bool = True,
        prompts: TenantPrompts | None = None,
        codec: TextCodec | None = None,
        worth_book: WorthBook | None = None,
    ) -> None:
        if max_tree_nodes < 1:
            raise InvalidArgument("max_tree_nodes must be >= 1")
        self.inner = inner
        self.reads: TargetReads = READS_NOTHING if inner is None else inner.reads  # the suffix index's own
        self.max_tree_nodes = max_tree_nodes
        self.cost = cost
        self.settings = settings
        self.shared = shared
        self.prompts = prompts  # where the index of a prompt the tenant sent before is kept
        # Whether the batch a round shares sizes its suffix candidates (greedy rounds only: suffix_drafter)
        self.batch_aware = batch_aware
        self.codec = codec  # matches the session's text on characters once it is constrained
        self.index = self._new_index()
        self.text_index: TextSuffixIndex | None = None  # (`constrain`)
        self._constrained = False
        self.trust = settings.initial_trust
        self._head: list[int] = []  # the sequence's first tokens: a later call must start with them
        # the suffix tokens the last round's tree predicted would be accepted (its trust's yardstick)
        self._predicted: float | None = None
        self._suffix_nodes: frozenset[int] = frozenset()  # that tree's suffix candidates
        # This session's rounds: tree nodes (root included) and tokens emitted, as running means; the
        # other sessions of a batch are taken to send the same. They start as the root alone.
        self.mean_nodes, self.mean_emitted = 1.0, 1.0
        self.num_model_calls = 0
        self.num_suffix_only_rounds = 0
        # The model weighed (`worth_book`): greedy sessions only (suffix_drafter), as it times rounds and
        # a sampled tree must not depend on time.
        self.worth_book = worth_book
        self.model_worth = None
        if worth_book is not None and inner is not None:
            self.model_worth = worth_book.priors.start(worth_book.key(constrained=False))
        self._model_called = False

    # -- the index follows the session ---------------------------------------------------------------
    def _new_index(self) -> SuffixIndex:
        return SuffixIndex(
            max_match=self.settings.max_match, max_occurrences=32, max_tokens=INDEX_WINDOW_TOKENS
        )

    def _sync(self, token_ids: Sequence[int]) -> None:
        """Extends the index by the tokens committed since the last round. A sequence that does not
        start as the indexed one did (a resumed or different session) is indexed from scratch."""
        known = len(self.index)
        if len(token_ids) < known or list(token_ids[: len(self._head)]) != self._head:
            self.index, self._head, known = self._new_index(), [], 0
            self.text_index = None if self.text_index is None else TextSuffixIndex(self.text_index.codec)
        if self.text_index is not None:
            self.text_index.extend(token_ids[len(self.text_index) :])
        if known == 0 and self.prompts is not None:  # the prompt: from the tenant's cached prefix
            self.prompts.cache.start(self.index, self.prompts.tenant, token_ids)
        else:
            self.index.extend(token_ids[known:])
        self._head.extend(token_ids[len(self._head) : HEAD_TOKENS])

    def observe(self, outcome: RoundOutcome) -> None:
        """Learns from the round this drafter proposed: the running means of its rounds, and trust from
        the suffix tokens accepted against the score predicted; the model drafter learns too."""
        if self.inner is not None:
            self.inner.observe(outcome)
        predicted, self._predicted = self._predicted, None
        if predicted is None:
            return  # not a round of this drafter's (the loop skipped asking it)
        if self._model_called and self.worth_book is not None and self.model_worth is not None:
            self.model_worth.observe(
                outcome.num_accepted_tokens
                - outcome.num_suffix_accepted_tokens
                - outcome.num_forced_accepted_tokens
            )
            self.worth_book.priors.record(self.worth_book.key(self._constrained), self.model_worth)
        self.mean_nodes = smoothed(self.mean_nodes, outcome.draft.tree.num_nodes)
        self.mean_emitted = smoothed(self.mean_emitted, len(outcome.accepted_nodes))  # + the bonus token
        if predicted <= 0:
            return
        alpha = self.settings.trust_smoothing
        accepted = outcome.num_suffix_accepted_tokens
        trust = (1 - alpha) * self.trust + alpha * accepted / predicted
        self.trust = min(SuffixTrust.MAX_TRUST, max(SuffixTrust.MIN_TRUST, trust))

    # -- a round -------------------------------------------------------------------------------------
    def _suffix_proposal(self, token_ids: Sequence[int]) -> SuffixProposal | None:
        s = self.settings
        own = self.index.propose(s.max_depth, s.max_nodes, s.min_score)
        if own is None and self.text_index is not None:
            # Only where the ids find nothing: a copy cut into other tokens (a JSON value's first word).
            # Beside an id match, character matches mostly repeat it at a cost, or add short guesses.
            own = self.text_index.propose(token_ids[-1], s.max_depth, s.max_nodes, s.min_score)
        if self.shared is None:
            return own
        other = self.shared.cache.propose(
            self.shared.tenant, token_ids, s.max_depth, s.max_nodes, s.min_score
        )
        if own is None or other is None:
            return own or other
        tree, scores, _ = merge_proposals(
            token_ids[-1], [(own.tree, own.scores), (other.tree, other.scores)], s.max_nodes
        )
        return SuffixProposal(tree, scores, max(own.match_length, other.match_length), own.num_occurrences)

    def _sized(self, proposal: SuffixProposal, base_nodes: int, batch_sessions: int) -> int:
        """Suffix nodes to keep (a prefix of the best-first order) after `base_nodes` tree nodes, in a
        forward shared with batch_sessions - 1 other sessions."""
        room = max(0, self.max_tree_nodes - base_nodes)
        gains = [self.trust * score for score in proposal.scores[1 : 1 + room]]
        if self.cost is None:
            return sum(1 for g in gains if g > 0)
        others = max(0, batch_sessions - 1) if self.batch_aware else 0
        load = load_like_this(others, self.mean_nodes, self.mean_emitted)
        best_k, best_rate, expected = 0, 0.0, 1.0 + load.other_expected
        for k in range(len(gains) + 1):
            if k:
                expected += gains[k - 1]
            rate = expected / self.cost.verify_s(base_nodes + k + load.other_nodes)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        self._sync(token_ids)
        worth = self.model_worth
        if worth is not None:
            worth.round_starts(len(token_ids))
        root = token_ids[-1]
        proposal = self._suffix_proposal(token_ids)
        k = self._sized(proposal, 1, batch_sessions) if proposal is not None else 0
        suffix_expected = sum(proposal.scores[1 : 1 + k]) * self.trust if proposal is not None else 0.0
        self._model_called = (
            self.inner is not None
            and suffix_expected < self.settings.model_skip_tokens
            and (worth is None or worth.should_ask())
        )
        if self.inner is None or not self._model_called:
            self.num_suffix_only_rounds += self.inner is not None
            draft = _suffix_only(root, proposal, k)
        else:
            self.num_model_calls += 1
            start = worth.clock() if worth is not None else 0.0
            model = self.inner.propose(token_ids, round_seed, batch_sessions)
            if worth is not None:
                worth.called(worth.clock() - start)
            draft = self._merged(root, model, proposal, batch_sessions)
        predicted = sum(proposal.scores[1 : 1 + k]) if proposal is not None and draft.suffix_nodes else 0.0
        self._predicted, self._suffix_nodes = predicted, draft.suffix_nodes
        return draft

    def _merged(
        self, root: int, model: DraftTree, proposal: SuffixProposal | None, batch_sessions: int
    ) -> DraftTree:
        if proposal is None or model.target_roots:
            return model
        if model.kind is not CandidateKind.FIXED:  # sampled candidates follow another rule: never mixed
            if model.num_draft_tokens:
                return model
            return _suffix_only(root, proposal, self._sized(proposal, 1, batch_sessions))
        k = self._sized(proposal, model.tree.num_nodes, batch_sessions)
        if k == 0:
            return model
        # Model nodes first (its own cost policy sized them); then suffix candidates best-first.
        n_model = model.tree.num_nodes
        model_scores = [2.0 - i / n_model for i in range(n_model)]  # above every suffix score, in order
        tree, _, origins = merge_proposals(
            root,
            [(model.tree, model_scores), (proposal.tree, proposal.scores)],
            min(self.max_tree_nodes - 1, n_model - 1 + k),
        )
        suffix_nodes = frozenset(i for i, origin in enumerate(origins) if origin == 1)
        return DraftTree(tree, CandidateKind.FIXED, suffix_nodes=suffix_nodes)

    def rounds_without_model(self, limit: int) -> AheadPlan:
        """PlansAhead: the rounds after this one that would not ask the model drafter, as its account
        stands (it does not pay, and is asked only once its skipped rounds run out), then rounds while
        suffix candidates alone expect `model_skip_tokens`, as in `propose`; every round when there is
        no model. A sampled session's rounds stay its loop's: where its tree is drafted must not change
        its draws (suffix_drafter gives every greedy session a book)."""
        if self.worth_book is None or limit <= 0:
            return AheadPlan(0)
        if self.inner is None:
            return AheadPlan(limit)
        worth = self.model_worth
        certain = 0 if worth is None or worth.pays() else min(limit, worth.explore.left)
        return AheadPlan(certain, limit - certain, self.settings.model_skip_tokens)

    def skip_rounds(self, count: int) -> None:
        """PlansAhead: rounds that ran elsewhere without the model use up its account's skipped ones."""
        if self.model_worth is not None:
            self.model_worth.explore.skip(count)

    def suffix_trust(self) -> SuffixTrust:
        """PlansAhead: the account a verifier's drafter continues from for the rounds it runs ahead."""
        pending = self._predicted
        nodes = self._suffix_nodes if pending is not None else frozenset()
        return SuffixTrust(self.trust, self.mean_nodes, self.mean_emitted, pending, nodes)

    def adopt_trust(self, account: SuffixTrust) -> None:
        """PlansAhead: continues from `account`; its pending proposal is the next round observed."""
        self.trust = account.trust
        self.mean_nodes, self.mean_emitted = account.mean_nodes, account.mean_emitted
        self._predicted, self._suffix_nodes = account.predicted, account.suffix_nodes

    @property
    def expected_suffix_tokens(self) -> float:
        """What the last round's suffix candidates were expected to add (the score `propose` skips the
        model at: SuffixSettings.model_skip_tokens)."""
        return (self._predicted or 0.0) * self.trust

    def open_round(self, token_ids: Sequence[int], batch_sessions: int) -> int:
        """Passes the round's sizing on to a model drafter that sizes rounds (RoundOpeningDrafter)."""
        if isinstance(self.inner, RoundOpeningDrafter):
            return self.inner.open_round(token_ids, batch_sessions)
        return self.settings.max_depth

    def constrain(self, grammar: GrammarState) -> None:
        """ConstrainedDrafter: the model drafter masks its own drafts (suffix candidates are shaped by the
        loop like any fixed candidates), and with a codec the session's text is matched on characters
        where the ids find nothing. A grammar's syntax cuts copied words into other tokens: a JSON value
        opens with `"` and `Maria` where the text has ` Maria`. In free text the ids find the copies,
        and character matches, short and many, cost more than they gain (docs/benchmarks.md)."""
        if self.worth_book is not None and self.model_worth is not None and not self._constrained:
            self.model_worth = self.worth_book.priors.start(self.worth_book.key(constrained=True))
        self._constrained = True
        if self.codec is not None and self.text_index is None:
            self.text_index = TextSuffixIndex(self.codec)
        if isinstance(self.inner, ConstrainedDrafter):
            self.inner.constrain(grammar)

    def know_prompt(self, num_tokens: int) -> None:
        """KnowsPrompt: the model drafter caches its state over the prompt."""
        if isinstance(self.inner, KnowsPrompt):
            self.inner.know_prompt(num_tokens)

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()


def suffix_drafter(
    inner: Drafter | None,
    max_tree_nodes: int,
    sampling: SamplingParams,
    cost: Callable[[], CostModel],
    shared: TenantCache | None = None,
    prompts: TenantPrompts | None = None,
    codec: TextCodec | None = None,
    worth: WorthBook | None = None,
) -> SuffixDrafter:
    """A session's suffix candidates, alone (`inner` None) or in front of its model drafter.

    `cost` gives the costs rounds are sized by, asked once: this machine's calibration in process (reading it
    may measure the machine), the session's target's published curve in the router: the same record where
    both serve one host. Greedy rounds are sized by the batch each round shares (`propose`'s
    batch_sessions) and may draft from `shared`, the tenant's earlier outputs. A sampled session's tree
    decides its random draws, so it is sized as if alone, whatever else runs, and drafts from its own text
    only: a seed gives the same text on a target of the same costs. (On the nominal curve, which reads
    verify(8) as 1.33 steps, a sampled session on a host where it costs 2 drafted at a loss: the default
    method ran 0.77-0.90x `target` at T = 0.7 on chat, docs/benchmarks.md, "Sampling at T > 0".) Either
    may start its index from `prompts`, the tenant's earlier prompts (core/prompt_indexes.py): that index
    is the one its own prompt would give. With `codec` (the serving tokenizer), a constrained session's
    text is also matched on characters where the ids find nothing (core/text_suffix.py;
    `SuffixDrafter.constrain`). A greedy session weighs its model drafter (`ModelWorth`), starting from
    what the model earned in the process's earlier sessions of its kind when `worth` says where that is
    kept."""
    if not sampling.greedy:
        return SuffixDrafter(inner, max_tree_nodes, cost(), batch_aware=False, prompts=prompts, codec=codec)
    return SuffixDrafter(
        inner,
        max_tree_nodes,
        cost(),
        shared=shared,
        prompts=prompts,
        codec=codec,
        worth_book=worth or WorthBook(WorthPriors(), "session"),  # None: this session's own account
    )


def _suffix_only(root: int, proposal: SuffixProposal | None, k: int) -> DraftTree:
    if proposal is None or k == 0:
        return DraftTree.root_only(root)
    tree = TokenTree(proposal.tree.token_ids[: 1 + k], proposal.tree.parent_ids[: 1 + k])
    return DraftTree(tree, CandidateKind.FIXED, suffix_nodes=frozenset(range(1, 1 + k)))
