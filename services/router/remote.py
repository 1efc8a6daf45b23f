"""The loop's Drafter and Verifier over gRPC: what the router plugs into `speculative_generate`.

RemoteVerifier keeps the session's committed history, so a target that lost the session (restart,
eviction, a retried commit) is rebuilt from it and the round is retried with the same seed: the output
does not change. RemoteDrafter sends only the tokens committed since its last call; when the draft
service fails or is too slow, the round verifies the root alone (lossless, just no speculation). When
the draft answers a round with the root alone because of the load, it says up to how many sessions on
the target its next round would draft (ProposeResponse.drafts_up_to_batch_sessions); while the target
reports more, RemoteDrafter answers the root alone itself, without the call, and asks again after at most
MAX_SKIPPED_CALLS such rounds in a row in case its estimates moved. Output does not change: the root
alone is what the draft would have sent.
Both send the session's sampling parameters once, in their service's Prefill (a rebuild too); a round
carries its tokens and seed. A drafted tree travels as the draft service sent it (WireDraftTree).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from specserve.core.constraint import Constraint
from specserve.core.protocols import (
    READS_NOTHING,
    AheadPlan,
    DraftTree,
    RoundOutcome,
    SuffixTrust,
    VerifyOutcome,
)
from specserve.core.sampling_params import SamplingParams
from specserve.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SpecserveError,
    Unavailable,
)
from specserve.serving.convert import (
    constraint_to_pb,
    outcome_from_pb,
    sampling_to_pb,
    suffix_trust_from_pb,
    suffix_trust_to_pb,
    tree_from_pb,
    tree_to_pb,
)
from specserve.serving.status import error_from_rpc
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)

RETRY_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0)
MAX_SKIPPED_CALLS = 8  # the loop's own back-off (core/backoff.py) spaces the calls too


@dataclass(frozen=True)
class WireDraftTree(DraftTree):
    """A tree as the draft service sent it. The router has no torch: the message (q of a sampled tree
    included, sparse) goes to the target untouched, and `draft_probs` stays empty."""

    message: common_pb2.DraftTree = field(default_factory=common_pb2.DraftTree)


def wire_tree(draft: DraftTree) -> common_pb2.DraftTree:
    """What a Verify carries: the draft's own message, or the structure of a tree made here (the root
    alone, when the draft failed or was not asked)."""
    return draft.message if isinstance(draft, WireDraftTree) else tree_to_pb(draft)


class Replica(Protocol):
    """Where a session's calls go (placement.HeldReplica): one address, moved after a failure."""

    address: str

    def move(self) -> str: ...


@dataclass
class RoundCounters:
    """Per-session numbers the loop's stats do not have."""

    rpc_bytes: int = 0
    kv_feed_bytes: int = 0
    draft_fallbacks: int = 0
    draft_calls_skipped: int = 0  # rounds the draft's load answer made the root alone without a call
    prepared_proposals: int = 0  # rounds whose tree the draft had built ahead from the KV feed
    target_rebuilds: int = 0
    draft_service_s: float = 0.0  # inside the draft's handler
    target_service_s: float = 0.0  # inside the target's Verify handler
    redis_s: float = 0.0


class RemoteVerifier:
    def __init__(
        self,
        session_id: str,
        stub_for: Callable[[str], target_pb2_grpc.TargetServiceStub],
        target: Replica,
        sampling: SamplingParams,
        capacity: int,
        timeout_s: float,
        counters: RoundCounters,
        is_cancelled: Callable[[], bool] = lambda: False,
        logprobs: int | None = None,  # None, or the top tokens to return with each token's logprob
        keep_hidden_states: bool = False,  # the session's draft reads the target's hidden states
        tenant: str = "",  # the session owner's principal: whose cached prefixes the target may use
        constraint: Constraint | None = None,
        num_prompt_tokens: int = 0,  # where the constrained text starts (a rebuild replays the rest)
        max_tree_nodes: int = 64,  # the most nodes a tree the target verified on its own may have
        max_ahead_rounds: int = 0,  # rounds a greedy session's target may run on its own (core/ahead.py)
        max_ahead_seconds: float = 0.0,  # how long a call may run before such a round starts (0: any)
    ) -> None:
        self.session_id = session_id
        self.max_tree_nodes = max_tree_nodes
        self.max_ahead_rounds = max_ahead_rounds
        self.max_ahead_seconds = max_ahead_seconds
        self.tenant = tenant
        self.cached_tokens = 0  # of the fresh prompt, those the target took from its prefix cache
        self.constraint = constraint_to_pb(constraint)  # sent with every Prefill, fresh or rebuild
        self.num_prompt_tokens = num_prompt_tokens
        self.keep_hidden_states = keep_hidden_states
        self.stub_for = stub_for
        self.target = target  # moves to another replica when this one is unavailable
        self.sampling = sampling  # the session's: sent with every Prefill, fresh or rebuild
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.counters = counters
        self.is_cancelled = is_cancelled
        # What the last Verify call cost on the wire, its seconds and Propose + Verify bytes, until taken
        # (`take_call`; the loop's RoundOutcome says what it drafted and accepted).
        self._last_call: tuple[float, int] | None = None
        self._bytes_before_round = 0
        self.history: list[int] = []  # committed tokens; the last is the root
        self.logprobs = logprobs
        self._logprobs: list[common_pb2.TokenLogprob] = []  # of the tokens the last call committed
        self._suffix_trust: SuffixTrust | None = None  # the last call's (take_suffix_trust)
        self.batch_sessions = 0  # sessions sharing the target, as its last Verify reported

    @property
    def address(self) -> str:
        """The target replica the session is on now."""
        return self.target.address

    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        request = target_pb2.PrefillRequest(
            session_id=self.session_id,
            token_ids=prompt_ids,
            capacity=self.capacity,
            sampling=sampling_to_pb(self.sampling),
            step_seed=round_seed,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            keep_hidden_states=self.keep_hidden_states,
            constraint=self.constraint,
            num_prompt_tokens=len(prompt_ids),
            tenant=self.tenant,
        )
        response = self._call("Prefill", request, rebuild=None)
        self.cached_tokens = response.cached_tokens
        self.batch_sessions = response.batch_sessions  # the load the first round's draft shares
        self._logprobs = [response.logprob] if response.HasField("logprob") else []
        self.history = [*prompt_ids, response.next_token]
        return response.next_token

    def resume(self, token_ids: Sequence[int]) -> None:
        self.history = list(token_ids)
        self._rebuild()

    @property
    def ahead_limit(self) -> int:
        """AheadVerifier: the rounds the target may run on its own after each Verify (core/ahead.py):
        none for a sampled or constrained session, or one that asks for logprobs."""
        if not self.sampling.greedy or self.constraint is not None or self.logprobs is not None:
            return 0
        return self.max_ahead_rounds

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        return self.verify_ahead(draft, round_seed, AheadPlan(0), 0)[0][1]

    def verify_ahead(
        self, draft: DraftTree, round_seed: int, plan: AheadPlan, max_tokens: int
    ) -> list[tuple[DraftTree, VerifyOutcome]]:
        """AheadVerifier: `draft`'s round, then those the target ran on its own (suffix candidates from
        the session's text), each as a tree of suffix candidates and its outcome."""
        request = target_pb2.VerifyRequest(
            session_id=self.session_id,
            tree=wire_tree(draft),
            committed_length=len(self.history),
            step_seed=round_seed,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
        )
        if plan.total and self.ahead_limit:
            request.ahead_rounds = plan.rounds
            request.ahead_copy_rounds = plan.copy_rounds
            request.ahead_copy_tokens = plan.copy_tokens
            request.ahead_max_tokens = max_tokens
            request.ahead_max_seconds = self.max_ahead_seconds
            request.ahead_skip_run = plan.skip_run
            request.ahead_skip_left = plan.skip_left
            if plan.suffix is not None:
                request.ahead_suffix.CopyFrom(suffix_trust_to_pb(plan.suffix))
        start = time.perf_counter()
        response = self._call("Verify", request, rebuild=self._rebuild)
        verify_s = time.perf_counter() - start
        self.counters.target_service_s += response.handler_seconds
        outcome = outcome_from_pb(response)
        self._logprobs = list(response.logprobs)
        self._suffix_trust = self._returned_trust(response)
        self.batch_sessions = response.batch_sessions
        self._last_call = (verify_s, self.counters.rpc_bytes - self._bytes_before_round)
        self._bytes_before_round = self.counters.rpc_bytes
        self.history += [draft.tree.token_ids[i] for i in outcome.accepted_nodes[1:]] + [response.next_token]
        done = [(draft, outcome)]
        for message in response.ahead:
            tree = tree_from_pb(message.tree, self.max_tree_nodes)  # suffix candidates only
            ahead = DraftTree(tree.tree, suffix_nodes=frozenset(range(1, tree.tree.num_nodes)))
            verified = VerifyOutcome(list(message.accepted_nodes), message.next_token)
            done.append((ahead, verified))
            self.history += [tree.tree.token_ids[i] for i in verified.accepted_nodes[1:]]
            self.history.append(message.next_token)
        return done

    def _returned_trust(self, response: target_pb2.VerifyResponse) -> SuffixTrust | None:
        """The target's suffix account after its rounds; one out of range is the target's fault, not the
        client's: the router's drafter then keeps its own, and the session goes on."""
        if not response.HasField("suffix"):
            return None
        try:
            return suffix_trust_from_pb(response.suffix, 0, self.max_tree_nodes)
        except InvalidArgument as e:
            logger.warning("target %s returned a suffix account out of range: %s", self.address, e)
            return None

    def take_suffix_trust(self) -> SuffixTrust | None:
        """AheadVerifier: the suffix account the last call's rounds left on the target, once."""
        taken, self._suffix_trust = self._suffix_trust, None
        return taken

    def take_call(self) -> tuple[float, int] | None:
        """The last Verify call's seconds and bytes, once: its first round reports them, not the rounds the
        target ran after it."""
        taken, self._last_call = self._last_call, None
        return taken

    def take_logprobs(self) -> list[common_pb2.TokenLogprob]:
        """The log-probabilities of the tokens the last Prefill or Verify committed (when asked for)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def release(self) -> None:
        try:
            self.stub_for(self.address).Release(
                target_pb2.ReleaseRequest(session_id=self.session_id), timeout=self.timeout_s
            )
        except grpc.RpcError as e:
            logger.warning("releasing target session %s: %s", self.session_id, error_from_rpc(e))

    def _rebuild(self) -> None:
        """The target lost the session (or holds a different length): rebuild it from the history."""
        request = target_pb2.PrefillRequest(
            session_id=self.session_id,
            token_ids=self.history[:-1],
            root_token=self.history[-1],
            capacity=self.capacity,
            sampling=sampling_to_pb(self.sampling),
            keep_hidden_states=self.keep_hidden_states,
            constraint=self.constraint,
            num_prompt_tokens=self.num_prompt_tokens,
            tenant=self.tenant,
        )
        self._call("Prefill", request, rebuild=None)
        self.counters.target_rebuilds += 1

    def _call(self, method: str, request, rebuild: Callable[[], None] | None):
        """Retries UNAVAILABLE (moving to another replica) until the timeout; NOT_FOUND / FAILED_PRECONDITION
        rebuild the session first (once per attempt)."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            if self.is_cancelled():
                raise Cancelled("the session was cancelled")
            try:
                stub = self.stub_for(self.address)
                remaining = max(0.1, deadline - time.monotonic())
                response = getattr(stub, method)(request, timeout=remaining)
                self.counters.rpc_bytes += request.ByteSize() + response.ByteSize()
                return response
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, f"target {self.address} {method}")
            if isinstance(error, NotFound | FailedPrecondition) and rebuild is not None:
                rebuild()
            elif isinstance(error, Unavailable) and time.monotonic() < deadline:
                self.target.move()
                time.sleep(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)])
                if rebuild is not None:
                    try:
                        rebuild()
                    except SpecserveError as e:
                        logger.info("rebuild on %s failed: %s", self.address, e)
            else:
                raise error
            attempt += 1
            if time.monotonic() > deadline:
                raise Unavailable(f"target {method} did not succeed within {self.timeout_s:.0f} s") from error


class RoundTripMean:
    """What Propose calls cost beyond the draft's own work (their transport and KV-feed waits), smoothed
    over every session of a router: where a new session's estimate starts, instead of nothing (its own
    calls take over from its second; the first carries one-time work)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds  # 0 = no call measured yet

    def observe(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds == 0 else 0.8 * self.seconds + 0.2 * seconds


class RemoteDrafter:
    def __init__(
        self,
        session_id: str,
        method: str,
        stub: draft_pb2_grpc.DraftServiceStub,
        target_address: Callable[[], str],
        sampling: SamplingParams,
        capacity: int,
        timeout_s: float,
        counters: RoundCounters,
        on_propose: Callable[[float], None] = lambda seconds: None,
        request_seed: int | None = None,  # lets the draft prepare each round's tree ahead (core/rng.py)
        round_trips: RoundTripMean | None = None,  # the router's, shared by its sessions
        constraint: Constraint | None = None,
        num_prompt_tokens: int = 0,  # where the constrained text starts, and the prompt's K/V end
        tenant: str = "",  # the session owner's principal: whose cached prefixes the draft may use
    ) -> None:
        self.session_id = session_id
        self.method = method
        self.tenant = tenant
        self.constraint = constraint_to_pb(constraint)  # sent with Prefill: the draft masks its own drafts
        self.num_prompt_tokens = num_prompt_tokens
        self.reads = READS_NOTHING  # the draft service reads the target's state, not the router
        self.sampling = sampling  # the session's: sent once, in Prefill
        self.request_seed = request_seed
        self.on_propose = on_propose  # seconds of each Propose round trip (fallbacks included)
        self.stub = stub
        self.target_address = target_address
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.counters = counters
        self.known = 0  # tokens the draft service has; 0 = needs a Prefill
        self.round_trips = round_trips
        # This session's Propose round trips, smoothed, starting from the router's
        self._round_trip = RoundTripMean(round_trips.seconds if round_trips is not None else 0.0)
        # The draft's last ProposeResponse.drafts_up_to_batch_sessions (None: it drafted, or said nothing)
        self.drafts_up_to: int | None = None
        self._skipped = 0  # rounds in a row answered without a call
        self._asked = False  # the last proposal came from a Propose call: its round's outcome is the draft's
        self._last_round_committed: int | None = None  # what that round committed, for the next call

    @property
    def overhead_s(self) -> float:
        """What asking the draft costs a round beyond the draft's own work: a Propose's round trip less
        its handler's time, plus the handler's wait for the KV feed, smoothed (0 = not known yet)."""
        return self._round_trip.seconds

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        """batch_sessions: the target's load, sent on for the draft's cost policy."""
        self._asked = False
        if self._root_alone_under_load(batch_sessions):
            self.counters.draft_calls_skipped += 1
            return DraftTree.root_only(token_ids[-1])
        start = time.perf_counter()
        try:
            try:
                return self._propose(token_ids, round_seed, batch_sessions)
            except NotFound:  # the draft restarted or evicted the session: open it again
                self.known = 0
                return self._propose(token_ids, round_seed, batch_sessions)
        except SpecserveError as e:
            logger.info("draft %s failed (%s); verifying the root alone", self.session_id, e)
            self.counters.draft_fallbacks += 1
            return DraftTree.root_only(token_ids[-1])
        finally:
            self.on_propose(time.perf_counter() - start)

    def _root_alone_under_load(self, batch_sessions: int) -> bool:
        """Whether the draft said this load makes the round the root alone (module doc)."""
        if self.drafts_up_to is None or batch_sessions <= self.drafts_up_to:
            return False
        if self._skipped >= MAX_SKIPPED_CALLS:
            return False
        self._skipped += 1
        return True

    def _propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> WireDraftTree:
        # The first Propose after a Prefill carries one-time work (the prompt's K/V reaching the draft
        # over the feed, the draft's own prefill): it is not what asking the draft costs a round.
        opening = self.known == 0
        try:
            if opening:
                prefill = draft_pb2.DraftPrefillRequest(
                    session_id=self.session_id,
                    method=self.method,
                    token_ids=token_ids,
                    target_address=self.target_address(),
                    capacity=self.capacity,
                    sampling=sampling_to_pb(self.sampling),
                    request_seed=self.request_seed,
                    constraint=self.constraint,
                    num_prompt_tokens=self.num_prompt_tokens,
                    tenant=self.tenant,
                )
                self.stub.Prefill(prefill, timeout=self.timeout_s)
                self.counters.rpc_bytes += prefill.ByteSize()
                self.known = len(token_ids)
            request = draft_pb2.ProposeRequest(
                session_id=self.session_id,
                from_position=self.known,
                new_token_ids=token_ids[self.known :],
                step_seed=round_seed,
                target_address=self.target_address(),
                batch_sessions=batch_sessions,
                overhead_seconds=self.overhead_s,
                last_round_committed=self._last_round_committed,
            )
            start = time.perf_counter()
            response = self.stub.Propose(request, timeout=self.timeout_s)
            round_trip_s = time.perf_counter() - start
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"draft {self.method} Propose") from None
        self.known = len(token_ids)
        self.counters.rpc_bytes += request.ByteSize() + response.ByteSize()
        self.counters.kv_feed_bytes = response.kv_feed_bytes
        self.counters.draft_service_s += response.handler_seconds
        if not opening:
            # The draft's steps and fixed cost are in its own cost model: what the router adds is the
            # transport and the wait for the KV feed.
            transport_s = max(0.0, round_trip_s - response.handler_seconds) + response.kv_wait_seconds
            self._round_trip.observe(transport_s)
            if self.round_trips is not None:
                self.round_trips.observe(transport_s)
        self.counters.prepared_proposals += response.prepared
        self._skipped = 0
        self._asked, self._last_round_committed = True, None
        self.drafts_up_to = (
            response.drafts_up_to_batch_sessions if response.HasField("drafts_up_to_batch_sessions") else None
        )
        draft = tree_from_pb(response.tree, self.capacity)
        if draft.tree.token_ids[0] != token_ids[-1]:
            raise FailedPrecondition("the draft's tree does not start at the root")
        return WireDraftTree(draft.tree, draft.kind, message=response.tree)

    def observe(self, outcome: RoundOutcome) -> None:
        """Nothing to send now: the next Propose carries the committed tokens and, for the round of the
        draft's own last tree, how many that round committed, from which the draft service's session reads
        the outcome in-process drafters observe (services/draft/sessions.py, observe_committed). Rounds
        the draft was not asked for (suffix candidates alone, skipped under load) are not its own."""
        if self._asked:
            self._asked, self._last_round_committed = False, len(outcome.emitted_token_ids)

    def release(self) -> None:
        try:
            self.stub.Release(
                draft_pb2.DraftReleaseRequest(session_id=self.session_id), timeout=self.timeout_s
            )
        except grpc.RpcError as e:
            logger.warning("releasing draft session %s: %s", self.session_id, error_from_rpc(e))
