"""A drafter backed by any smaller causal LM sharing the target's tokenizer.

It drafts a spine of up to `depth` tokens autoregressively; at each depth it may add extra candidates
as leaves beside the spine token (nothing is drafted under them), which turns the chain into a tree.
At T == 0 candidates are the draft's top-w (fixed); at T > 0 they are drawn from the draft's
processed distribution q (sampled, with or without replacement) or taken as its top-w (fixed).
A stop policy (core/stopping.py) may end the spine sooner; it learns from each round's acceptance.
The session's sampling parameters are given at construction; a round passes its tokens and seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from specserve.core.cape import CapeSettings, cape_width, draft_confidence, fit_width
from specserve.core.grammar import GrammarState
from specserve.core.protocols import READS_NOTHING, CandidateKind, DraftTree, RoundOutcome, TargetReads
from specserve.core.sampling import logits_to_probs, make_generator, sample_without_replacement
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stopping import (
    STOP_POLICIES,
    CostPolicy,
    DraftStep,
    RoundPolicy,
    StopPolicy,
    StopPolicyName,
    StopSettings,
    WidthPolicy,
)
from specserve.core.tree import TokenTree, tree_children
from specserve.errors import InvalidArgument
from specserve.grammar.masks import SpineMasks
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.prefix_cache import DraftBlocks, DraftPrefix
from specserve.runtime.runner import ModelRunner
from specserve.runtime.stopper import make_stop_policy
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK


@dataclass(frozen=True)
class DraftShape:
    """depth caps the spine; the stop policy decides, round by round, how much of it is drafted.

    With the default fixed policy every round drafts exactly `depth` spine tokens. Other policies draft
    at most min(depth, their own cap): e.g. DraftShape(depth=40, stop=StopPolicyName.SVIP) is SVIP's
    official setting, DraftShape(depth=4, stop=StopPolicyName.SVIP) lets it only shorten rounds of 4.
    """

    depth: int = 4  # most spine tokens drafted per round
    widths: tuple[int, ...] = ()  # candidates at each depth (spine token included); missing = 1
    sampled_kind: CandidateKind = CandidateKind.SAMPLED  # candidate rule at T > 0
    stop: StopPolicyName = StopPolicyName.FIXED
    stop_settings: StopSettings | None = None  # None = the policy's defaults

    def __post_init__(self) -> None:
        if self.depth < 0 or any(w < 1 for w in self.widths) or len(self.widths) > self.depth:
            raise InvalidArgument(f"invalid draft shape {self}")
        if self.stop not in STOP_POLICIES:  # a StrEnum member equals its value, so "svip" passes too
            raise InvalidArgument(f"unknown stop policy {self.stop!r}; valid: {', '.join(STOP_POLICIES)}")

    def width(self, depth_index: int) -> int:
        return self.widths[depth_index] if depth_index < len(self.widths) else 1

    def new_stop_policy(self) -> StopPolicy:
        """A fresh policy (fresh online state) for one drafter.

        The fixed and gated policies draft `depth` tokens whatever fixed_depth the settings carry: the
        shape is the one place a fixed depth is set. StopSettings needs fixed_depth >= 1; a depth of 0
        still gives empty spines because the spine is capped by `depth` too.
        """
        settings = self.stop_settings if self.stop_settings is not None else StopSettings()
        if StopPolicyName(self.stop).whole_depth:
            settings = replace(settings, fixed_depth=max(1, self.depth))
        return make_stop_policy(self.stop, settings)


class PolicyDrafter:
    """What every drafter with a stop policy shares: the session's sampling parameters, the candidate
    kind they imply, a stop policy that learns from each round (SpineFeedback), and `propose` around
    the drafter's own `_draft`.

    One policy per drafter, i.e. per request: it holds online state. `stop_policy` is public so a
    caller may swap in its own StopPolicy.
    """

    reads: TargetReads = READS_NOTHING  # a drafter of the target's state says which (GliDe, eagle)

    def __init__(
        self, sampled_kind: CandidateKind, stop_policy: StopPolicy, sampling: SamplingParams
    ) -> None:
        self.sampling = sampling
        self.kind = CandidateKind.FIXED if sampling.greedy else sampled_kind
        self.stop_policy = stop_policy
        if isinstance(stop_policy, CostPolicy):
            stop_policy.batch_aware = sampling.greedy  # seeded sampling stays reproducible under load
        self._feedback = SpineFeedback()
        self._opened: int | None = None  # length of the sequence whose round open_round opened
        self.grammar: GrammarState | None = None  # the session's constraint, if any (constrain)

    def constrain(self, grammar: GrammarState) -> None:
        """ConstrainedDrafter: the draft's logits are masked by the session's language as it drafts."""
        self.grammar = grammar

    def open_round(self, token_ids: Sequence[int], batch_sessions: int) -> int:
        """Starts the round whose root is token_ids[-1], beside batch_sessions - 1 other sessions: a
        RoundPolicy sizes it. Returns the policy's cap; 0 = the round drafts nothing, so a caller need
        not wait for anything the draft reads. `propose` opens the round itself unless this did."""
        if isinstance(self.stop_policy, RoundPolicy):
            self.stop_policy.start_round(batch_sessions)
        self._opened = len(token_ids)
        return self.stop_policy.max_depth

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        if self._opened != len(token_ids):
            self.open_round(token_ids, batch_sessions)
        self._opened = None
        draft = self._draft(token_ids, make_generator(round_seed))
        self._feedback.record(token_ids, draft)
        return draft

    def observe(self, outcome: RoundOutcome) -> None:
        """The stop policy learns how the round it sized went (SpineFeedback)."""
        self._feedback.report(outcome, self.stop_policy)

    def release(self) -> None:
        """Ends the request: the pending round goes (drafters with caches free them too)."""
        self._feedback.reset()

    # -- CostSizedDrafter: what a draft service tells and asks the cost policy, through the drafter ----
    @property
    def _cost_policy(self) -> CostPolicy | None:
        return self.stop_policy if isinstance(self.stop_policy, CostPolicy) else None

    def charge_overhead(self, seconds: float) -> None:
        if self._cost_policy is not None:
            self._cost_policy.transport_s = seconds

    def drafts_up_to(self, batch_sessions: int) -> int | None:
        policy = self._cost_policy
        if policy is None or not policy.batch_aware:
            return None
        return policy.largest_drafting_batch(batch_sessions)

    def acceptance(self) -> tuple[float, int]:
        policy = self._cost_policy
        return (0.0, 0) if policy is None else (policy.mean_acceptance, policy.num_drafting_rounds)

    def start_from(self, acceptance: float) -> None:
        policy = self._cost_policy
        if policy is not None and policy.batch_aware:
            policy.mean_acceptance = acceptance

    def _draft(self, token_ids: Sequence[int], generator: torch.Generator) -> DraftTree:
        raise NotImplementedError


class SpineDrafter(PolicyDrafter):
    """A PolicyDrafter that drafts a spine of `shape` (grow_spine_tree): ModelDrafter, GlideDrafter."""

    def __init__(self, shape: DraftShape, sampling: SamplingParams, sampled_kind: CandidateKind) -> None:
        super().__init__(sampled_kind, shape.new_stop_policy(), sampling)
        self.shape = shape

    def open_round(self, token_ids: Sequence[int], batch_sessions: int) -> int:
        """The round's spine cap: the shape's depth, further capped by the policy (spine_cap)."""
        return min(self.shape.depth, super().open_round(token_ids, batch_sessions))

    def _grow(
        self,
        token_ids: Sequence[int],
        logits: torch.Tensor,  # [V] draft logits after the root
        width_at: Callable[[int, torch.Tensor, int], int],
        advance: Callable[[int, int], torch.Tensor],
        generator: torch.Generator,
    ) -> DraftTree:
        root = token_ids[-1]
        masks = SpineMasks(self.grammar, token_ids) if self.grammar is not None else None
        try:
            return grow_spine_tree(
                root,
                logits,
                self.shape.depth,
                width_at,
                advance,
                self.sampling,
                self.kind,
                generator,
                self.stop_policy,
                masks,
            )
        finally:
            if masks is not None:
                masks.release()


class WidthDrafter(SpineDrafter):
    """A SpineDrafter whose trees have the shape's fixed widths, or CaPE's widths by the draft's
    confidence (then the candidates are fixed, so the verifier needs no q): GlideDrafter, EagleDrafter.
    `head_size`: how many tokens the draft's head can score (a reduced head scores no more)."""

    def __init__(
        self, shape: DraftShape, cape: CapeSettings | None, sampling: SamplingParams, head_size: int
    ) -> None:
        if cape is not None and shape.widths:
            raise InvalidArgument("CaPE chooses the widths; give DraftShape only a depth")
        super().__init__(shape, sampling, CandidateKind.FIXED if cape is not None else shape.sampled_kind)
        self.cape = cape
        self.head_size = head_size

    def _width(self, depth_index: int, logits: torch.Tensor, num_nodes: int, max_depth: int) -> int:
        """max_depth: this round's spine cap. CaPE reserves one node per depth still to come under it; a
        policy that stops earlier leaves those nodes unused rather than let the tree outgrow its budget."""
        if self.cape is None:
            width = self.shape.width(depth_index)
        else:
            width = cape_width(draft_confidence(logits), self.cape.bins)
            depths_after = max_depth - depth_index - 1
            width = fit_width(width, num_nodes, depths_after, self.cape.max_tree_nodes)
        return min(width, self.head_size)


class ModelDrafter(WidthDrafter):
    """A separate causal LM (a smaller sibling of the target) drafting a spine with fixed widths, or
    CaPE's widths by its confidence.

    It catches its cache up in chunks at absolute multiples of `prefill_chunk`, as the target prefills,
    so the K/V of a whole chunk fed from where the exact positions end are what any prefill of those
    tokens computes, bit for bit (runtime/prefix_cache.py). With a `prefix`, a request starts from the
    longest such prefix an earlier one cached, and caches its own: its drafts are the cold ones.
    """

    def __init__(
        self,
        runner: ModelRunner,
        capacity: int,
        shape: DraftShape,
        sampling: SamplingParams = GREEDY,
        cape: CapeSettings | None = None,
        prefix: DraftPrefix | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        super().__init__(shape, cape, sampling, runner.vocab_size)
        self.runner = runner
        self.cache: PositionalKVCache = runner.new_cache(capacity)
        self._cached_ids: list[int] = []  # tokens whose KV the draft cache holds, in order
        # Its K/V depend on the tokens alone: every position is cacheable (no limit short of capacity).
        self.blocks = DraftBlocks(prefix, prefill_chunk, limit=capacity)

    def _draft(self, token_ids: Sequence[int], generator: torch.Generator) -> DraftTree:
        max_depth = spine_cap(self.shape.depth, self.stop_policy)  # the cap grow_spine_tree applies
        if max_depth == 0:
            # Nothing is worth drafting (the batch-aware cost policy under load): no draft forward; the
            # cache catches up on the next round that drafts.
            return DraftTree.root_only(token_ids[-1])
        logits = self._sync(token_ids)  # [V] after the root

        def advance(spine_token: int, depth_index: int) -> torch.Tensor:
            self._cached_ids.append(spine_token)
            return self.runner.forward(self.cache, [spine_token], last_only=True)

        def width_at(depth_index: int, logits: torch.Tensor, num_nodes: int) -> int:
            return self._width(depth_index, logits, num_nodes, max_depth)

        return self._grow(token_ids, logits, width_at, advance, generator)

    def _sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The cache caught up with the committed tokens (from the cached prefix on the first round, never
        the root, whose logits are computed); whole chunks it computed exactly are cached. Returns the
        logits after the root [V]."""
        if not self._cached_ids:
            self._cached_ids = list(token_ids[: self.blocks.load(token_ids, len(token_ids) - 1, self.cache)])
        keep = common_prefix_length(self._cached_ids, token_ids[:-1])
        logits = sync_draft_cache(self.runner, self.cache, self._cached_ids, token_ids, self.blocks.chunk)
        self.blocks.encoded(self._cached_ids, keep, len(token_ids), self.cache)
        return logits

    def release(self) -> None:
        """Ends the request: the cache and the pending round go; the policy's learning stays with the
        drafter (the engine makes one drafter per request anyway)."""
        self.cache.truncate(0)
        self._cached_ids.clear()
        self.blocks.reset()
        self._feedback.reset()


def sync_draft_cache(
    runner: ModelRunner,
    cache: PositionalKVCache,
    cached_ids: list[int],
    token_ids: Sequence[int],
    chunk: int | None = None,
) -> torch.Tensor:
    """A causal draft's cache for a round: keeps the KV that still matches the committed tokens (never
    the root), feeds the rest with the root, in one forward or (`chunk`) cut at absolute multiples of it;
    `cached_ids` follows. Returns the logits after the root [V]."""
    keep = common_prefix_length(cached_ids, token_ids[:-1])
    cache.truncate(keep)
    del cached_ids[keep:]
    cached_ids.extend(token_ids[keep:])
    bounds = [(keep, len(token_ids))] if chunk is None else chunk_bounds(keep, len(token_ids), chunk)
    logits = torch.empty(0)
    for start, end in bounds:  # the last chunk holds the root
        logits = runner.forward(cache, list(token_ids[start:end]), last_only=True)
    return logits


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) cut where absolute multiples of `chunk` fall, as a prefill cuts a prompt."""
    cuts = [start, *range((start // chunk + 1) * chunk, end, chunk), end]
    return list(itertools.pairwise(cuts))


def spine_cap(depth: int, stop: StopPolicy | None) -> int:
    """Most spine tokens the next round drafts: the shape's depth, further capped by the policy."""
    return depth if stop is None else min(depth, stop.max_depth)


def grow_spine_tree(
    root_token: int,
    logits: torch.Tensor,  # [V] draft logits after the root
    depth: int,
    width_at: Callable[[int, torch.Tensor, int], int],  # (depth index, logits, nodes so far) -> width
    advance: Callable[[int, int], torch.Tensor],  # (spine token, depth index) -> logits after it [V]
    params: SamplingParams,
    kind: CandidateKind,
    generator: torch.Generator,
    stop: StopPolicy | None = None,
    masks: SpineMasks | None = None,
) -> DraftTree:
    """Drafts a spine of up to spine_cap(depth, stop) tokens; each depth's extra candidates hang beside
    the spine token as leaves. Shared by every autoregressive drafter.

    With `masks` (a constraint), each depth's logits are masked by the language after the spine so far
    before anything reads them (widths, confidences, candidates, q), so nothing it forbids is drafted,
    at any temperature; the spine ends where the language allows nothing more.

    The spine ends early when a width is 0 or when `stop` says so; a `WidthPolicy` may also narrow each
    depth's width (asked before the candidates are picked, then `should_stop` for the same depth).
    `stop.should_stop` is asked once per
    spine token, right after it is chosen and before any forward on it (SVIP: the token is kept with its
    leaves, and no draft forward is wasted). It is asked for the last token at the cap too, so a policy
    sees as many steps as `observe` will count.
    The first candidate at each depth carries the spine, so `spine_token_ids` recovers it from the tree.
    """
    nodes, parents = [root_token], [-1]
    draft_probs: dict[int, torch.Tensor] = {}
    parent = 0
    max_depth = spine_cap(depth, stop)
    for d in range(max_depth):
        if masks is not None:
            masked = masks.apply(logits)
            if masked is None:
                break
            logits = masked
        width = width_at(d, logits, len(nodes))
        if masks is not None:  # no more candidates than the language allows here
            width = min(width, int(torch.isfinite(logits).sum()))
        if width == 0:
            break
        if isinstance(stop, WidthPolicy):  # the cost policy may keep fewer candidates than offered
            width = stop.choose_width(d, logits, width)
        candidates, q = pick_candidates(logits, params, kind, width, generator)
        if q is not None:
            draft_probs[parent] = q
        spine = len(nodes)
        nodes.extend(candidates)
        parents.extend([parent] * len(candidates))
        stopped = stop is not None and stop.should_stop(DraftStep(d, logits, nodes[spine]))
        if stopped or d + 1 == max_depth:
            break
        if masks is not None:
            masks.advance(nodes[spine])
        logits = advance(nodes[spine], d)
        parent = spine
    return DraftTree(TokenTree(tuple(nodes), tuple(parents)), kind, draft_probs)


def spine_token_ids(tree: TokenTree) -> list[int]:
    """The spine of a tree built by grow_spine_tree, root excluded: the first child at each depth."""
    children = tree_children(tree.parent_ids)
    spine: list[int] = []
    node = 0
    while children[node]:
        node = children[node][0]
        spine.append(tree.token_ids[node])
    return spine


class SpineFeedback:
    """Reports each round's (spine tokens drafted, spine tokens accepted) to a stop policy.

    The round's outcome (RoundOutcome) says what it committed: the accepted path, then one bonus or
    recovered token. The leading tokens of the drafter's own spine among them are the accepted ones. That
    count is exact under every rule in core/verify.py: a rejected spine token is never emitted at its depth
    (greedy emits the target's argmax, which differs; the sampled and fixed rules leave it no mass in the
    residual), and a path through a leaf leaves the spine there. The drafter's own spine is compared, not
    the verified tree's first children: the tree may be its proposal merged with suffix candidates.

    Only spine tokens count as drafted: leaves are alternatives at a depth, not length, and length is
    what the policies decide (each judges one token per spine position). An outcome when nothing was
    proposed since the last (the loop did not ask this drafter) reports nothing.
    """

    def __init__(self) -> None:
        self._spine: list[int] | None = None  # the last proposal's spine tokens, root excluded; None = none
        self._root_token = -1  # and its root

    def report(self, outcome: RoundOutcome, policy: StopPolicy) -> None:
        spine, self._spine = self._spine, None
        if spine is None or outcome.draft.tree.token_ids[0] != self._root_token:
            return
        policy.observe(len(spine), common_prefix_length(spine, outcome.emitted_token_ids))

    def record(self, token_ids: Sequence[int], draft: DraftTree) -> None:
        """Call with the proposal just made from `token_ids`."""
        self._root_token = token_ids[-1]
        self._spine = spine_token_ids(draft.tree)

    def reset(self) -> None:
        self._spine = None


def common_prefix_length(cached_ids: Sequence[int], token_ids: Sequence[int]) -> int:
    """How many leading tokens a draft cache can keep: those equal to the committed sequence."""
    keep, limit = 0, min(len(cached_ids), len(token_ids))
    while keep < limit and cached_ids[keep] == token_ids[keep]:
        keep += 1
    return keep


def pick_candidates(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    kind: CandidateKind,
    width: int,
    generator: torch.Generator,
) -> tuple[list[int], torch.Tensor | None]:
    """Returns the candidate tokens (spine first) and q when the verifier needs it (sampled kinds)."""
    if params.greedy:
        return torch.topk(logits, width).indices.tolist(), None
    # On the CPU, like the verifier: seeded generators are CPU generators, and q is compared with p there.
    q = logits_to_probs(logits.cpu(), params)  # [V]
    width = min(width, int((q > 0).sum()))
    if kind is CandidateKind.FIXED:
        return torch.topk(q, width).indices.tolist(), None
    if kind is CandidateKind.SAMPLED and width > 1:
        return torch.multinomial(q, width, replacement=True, generator=generator).tolist(), q
    # One uniform draw a token (a chain's, or each distinct one), not one random number per vocabulary
    # token as torch.multinomial draws without replacement.
    return sample_without_replacement(q, width, generator), q
