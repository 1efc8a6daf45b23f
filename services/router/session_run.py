"""One run of a session on a router worker thread: placement, the core loop, Redis and the client's queue.

`SessionRun.run` is the whole generation; each step is a method with one job:
- placement: one target (and one draft) replica per run, chosen once; its load is counted while the run
  holds it and follows the session when a retry moves it to another replica (placement.HeldReplica);
- the roles: the loop's RemoteVerifier and RemoteDrafter;
- each emission: latency metrics, the tokens appended to Redis (before anyone sees them), then the round
  on the queue the client's stream reads;
- the end: cumulative stats written to Redis with the finish, the final text on the queue; on failure
  or cancellation the error on the queue (and a cancelled session's state deleted).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from services.router.placement import HeldReplica
from services.router.prefix_routing import PrefixDirectory
from services.router.remote import RemoteDrafter, RemoteVerifier, RoundCounters
from services.router.state import SessionRecord, SessionStatus
from specserve.catalog import method_info
from specserve.core.cost import CostModel
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.prompt_indexes import TenantPrompts
from specserve.core.protocols import Drafter, RoundOutcome
from specserve.core.suffix_drafter import WorthBook, WorthPriors, suffix_drafter
from specserve.errors import Cancelled, SpecserveError
from specserve.grammar import Guide
from specserve.results import FinishReason, GenerationStats
from specserve.serving import telemetry
from specserve.serving.convert import stats_to_pb
from specserve.v1 import common_pb2, draft_pb2_grpc, router_pb2

if TYPE_CHECKING:
    import grpc

    from services.router.placement import ReplicaSet
    from services.router.remote import RoundTripMean
    from services.router.state import SessionState
    from services.router.tokenizer import RouterTokenizer
    from specserve.core.request import RequestLimits
    from specserve.core.suffix_drafter import TenantCache
    from specserve.serving.metrics import RouterMetrics
    from specserve.serving.settings import RouterServiceSettings
    from specserve.serving.target_costs import PublishedCosts
    from specserve.v1 import target_pb2_grpc

logger = logging.getLogger(__name__)


class Router(Protocol):
    """What a run uses of the router that started it: servicer.RouterServicer. Named here so that the
    dependency points one way (servicer.py starts runs; this module never imports it)."""

    settings: RouterServiceSettings
    metrics: RouterMetrics
    state: SessionState
    targets: ReplicaSet
    drafts: ReplicaSet | None  # None: no draft service
    draft_round_trips: RoundTripMean
    worth_priors: WorthPriors

    @property
    def tokenizer(self) -> RouterTokenizer: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def limits(self) -> RequestLimits: ...

    def suffix_cache_for(self, owner: str) -> TenantCache | None: ...

    def prompt_indexes_for(self, owner: str) -> TenantPrompts | None: ...

    @property
    def prefix_directory(self) -> PrefixDirectory | None: ...

    @property
    def target_costs(self) -> PublishedCosts: ...

    def target_stub(self, address: str) -> target_pb2_grpc.TargetServiceStub: ...

    def draft_channel(self, address: str) -> grpc.Channel: ...


@dataclass
class Done:
    """The last item of a run's queue."""

    reason: FinishReason
    stats: router_pb2.GenerationStats
    text: str  # the finished text (cut before a stop string)


@dataclass
class Round:
    """One round's tokens as the worker hands them to the stream."""

    token_ids: list[int]
    num_draft_tokens: int
    num_accepted_tokens: int  # the first this many of token_ids came from the draft
    logprobs: list[common_pb2.TokenLogprob]
    num_suffix_accepted_tokens: int = 0  # the last this many of the accepted came from the suffix index
    num_suffix_draft_tokens: int = 0  # of num_draft_tokens, the suffix index's
    num_forced_accepted_tokens: int = 0  # the last this many of the accepted were forced by a constraint
    num_forced_draft_tokens: int = 0  # of num_draft_tokens, the constraint's forced tokens


class SessionRun:
    def __init__(
        self,
        router: Router,
        record: SessionRecord,
        generated: list[int],
        out: queue.Queue,
        cancel: threading.Event,
        logprobs: int | None = None,
    ) -> None:
        self.router, self.record, self.generated = router, record, generated
        self.out, self.cancel, self.logprobs = out, cancel, logprobs
        self.session_id = record.session_id
        self.counters = RoundCounters()
        # The round the loop is about to emit (None: the prefill's first token, a round without a draft).
        self._this_round: RoundOutcome | None = None
        self._start = self._last_emit = time.perf_counter()
        self._first = not generated
        self.target: HeldReplica | None = None
        self.draft: HeldReplica | None = None
        self.verifier: RemoteVerifier | None = None
        self.drafter: RemoteDrafter | None = None
        self._load_released = False
        # Rounds emitted inside a round's scope, not yet in Redis nor with the client (`_round_scope`)
        self._pending: list[Round] = []
        self._in_round = False

    def run(self) -> None:
        """Until the session finishes, fails or is cancelled; everything it holds is freed."""
        router, request = self.router, self.record.request
        router.metrics.running_requests.inc()
        try:
            grammar = self._grammar()
            verifier, drafter = self._place(grammar)
            finish = FinishChecker.for_request(
                request.stopping, router.eos_token_ids, router.tokenizer.decode
            )
            assert request.seed is not None, "a session's seed is fixed when it starts"
            attributes = {telemetry.ATTR_SESSION: self.session_id, telemetry.ATTR_METHOD: request.method}
            with telemetry.span(telemetry.SPAN_REQUEST, **attributes):
                stats = speculative_generate(
                    self.record.prompt_ids,
                    verifier,
                    drafter,
                    request.seed,
                    finish,
                    self._emit,
                    generated_ids=self.generated,
                    round_scope=self._round_scope,
                    on_round=self._on_round,
                    batch_sessions=lambda: self._target_load(verifier),
                    grammar=grammar,
                )
            stats.num_cached_tokens = verifier.cached_tokens
            self._finish(finish, stats)
        except BaseException as e:
            self._fail(e)
        finally:
            self._free()

    def _grammar(self) -> Guide | None:
        """The loop's guide through the session's constraint: it shapes drafts (the target masks)."""
        constraint = self.record.request.constraint
        if constraint is None:
            return None
        compiler = self.router.tokenizer.grammar_compiler
        return compiler.guide(constraint, len(self.record.prompt_ids), self.router.limits.max_tree_nodes)

    # -- placement and roles -------------------------------------------------------------------------
    def _place(self, grammar: Guide | None) -> tuple[RemoteVerifier, Drafter | None]:
        """The replicas this run uses, chosen once (where the session was, else the least loaded), and
        the loop's roles on them. Suffix candidates are drafted here, in front of the draft service: the
        router sees every token, and a suffix-only round then costs no Propose call."""
        router, record = self.router, self.record
        method = method_info(record.request.method)
        directory = router.prefix_directory if not record.target else None  # a new session: no affinity
        blocks = None
        if directory is not None:
            blocks = directory.matched_blocks(record.owner, record.prompt_ids, router.targets.addresses)
        self.target = HeldReplica(router.targets, self.session_id, record.target, blocks)
        if directory is not None:
            directory.record(self.target.address, record.owner, record.prompt_ids)
        verifier = self.verifier = self._verifier(self.target)
        if method.drafts and router.drafts is not None:
            self.draft = HeldReplica(router.drafts, self.session_id, record.draft)
            self.drafter = self._drafter(self.draft, verifier, method.model_method)
        if not method.suffix:
            return verifier, self.drafter
        suffix = suffix_drafter(
            self.drafter,
            router.limits.max_tree_nodes,
            record.request.sampling,
            # the session's target's published curve; suffix candidates cost no draft forward
            lambda: CostModel(router.target_costs.of(verifier.address), draft_step_s=0.0),
            shared=router.suffix_cache_for(record.owner),
            prompts=router.prompt_indexes_for(record.owner),
            codec=router.tokenizer.codec,
            worth=WorthBook(router.worth_priors, method.model_method),
        )
        if grammar is not None:
            # The loop's guide: the model drafter here is remote and never walks it (the draft service
            # keeps its own); the suffix drafter only learns it is constrained.
            suffix.constrain(grammar)
        return verifier, suffix

    def _release_load(self) -> None:
        """The run's count on its replicas and among running requests, given back once. Done before the
        client hears the end (the role's Release calls come after): a request the client sends next is
        then placed as if this one had finished, which it has, and not sent away from its prefix."""
        if self._load_released:
            return
        self._load_released = True
        self.router.metrics.running_requests.dec()
        for replica in (self.target, self.draft):
            if replica is not None:
                replica.release()

    def _free(self) -> None:
        router = self.router
        router.state.release_lease(self.session_id)
        self._release_load()
        router.metrics.draft_fallbacks.inc(self.counters.draft_fallbacks)
        router.metrics.draft_calls_skipped.inc(self.counters.draft_calls_skipped)
        router.metrics.target_rebuilds.inc(self.counters.target_rebuilds)
        for role in (self.verifier, self.drafter):
            if role is not None:
                role.release()  # on the replica the role used last

    @property
    def _capacity(self) -> int:
        return self.router.limits.capacity(
            len(self.record.prompt_ids), self.record.request.stopping.max_new_tokens
        )

    def _verifier(self, target: HeldReplica) -> RemoteVerifier:
        router = self.router
        return RemoteVerifier(
            self.session_id,
            router.target_stub,
            target,
            self.record.request.sampling,
            self._capacity,
            router.settings.target_timeout_seconds,
            self.counters,
            is_cancelled=self.cancel.is_set,
            logprobs=self.logprobs,
            keep_hidden_states=method_info(self.record.request.method).hidden_states,
            constraint=self.record.request.constraint,
            num_prompt_tokens=len(self.record.prompt_ids),
            tenant=self.record.owner,
            max_tree_nodes=router.limits.max_tree_nodes + 1,  # a Verify's bound (root included)
            max_ahead_rounds=router.settings.max_ahead_rounds,
            max_ahead_seconds=router.settings.max_ahead_ms / 1000,
        )

    def _drafter(self, draft: HeldReplica, verifier: RemoteVerifier, method: str) -> RemoteDrafter:
        router, request = self.router, self.record.request
        return RemoteDrafter(
            self.session_id,
            method,
            draft_pb2_grpc.DraftServiceStub(router.draft_channel(draft.address)),
            lambda: verifier.address,
            request.sampling,
            self._capacity,
            router.settings.draft_timeout_seconds,
            self.counters,
            on_propose=router.metrics.draft_rpc_latency.observe,
            request_seed=request.seed,
            round_trips=router.draft_round_trips,
            constraint=request.constraint,
            num_prompt_tokens=len(self.record.prompt_ids),
            tenant=self.record.owner,
        )

    def _target_load(self, verifier: RemoteVerifier) -> int:
        """Sessions sharing this session's target: the target's own count (every router's sessions), or
        this router's sessions there when more (at the first rounds of sessions that start together,
        before the target has seen them all)."""
        return max(verifier.batch_sessions, self.router.targets.load(verifier.address))

    # -- rounds ----------------------------------------------------------------------------------------
    @contextmanager
    def _round_scope(self, position: int) -> Iterator[None]:
        """A round of the loop, with the rounds its Verify call ran on the target after it: their
        tokens go to Redis in one append when the last is emitted, then to the client's queue."""
        attributes = {telemetry.ATTR_SESSION: self.session_id, "specserve.position": position}
        with telemetry.span(telemetry.SPAN_ROUND, **attributes):
            self._in_round = True
            try:
                yield
            finally:
                self._in_round = False
                self._flush()

    def _on_round(self, outcome: RoundOutcome) -> None:
        """The loop's account of the round, before its tokens are emitted; the wire's from the verifier."""
        self._this_round = outcome
        verifier = self.verifier
        assert verifier is not None
        self.router.metrics.observe_round(
            outcome.draft.num_draft_tokens, outcome.num_accepted_tokens, verifier.take_call()
        )

    def _emit(self, token_ids: list[int]) -> None:
        """New tokens: metrics, then Redis, then the client's queue (a resumed stream never misses any);
        inside a round's scope the last two wait for its end (`_flush`)."""
        metrics = self.router.metrics
        now = time.perf_counter()
        if self._first:
            metrics.time_to_first_token.observe(now - self._start)
            self._first = False
        else:
            metrics.inter_token_latency.observe((now - self._last_emit) / len(token_ids))
        self._last_emit = now
        verifier = self.verifier
        assert verifier is not None
        outcome, self._this_round = self._this_round, None
        num_draft = 0 if outcome is None else outcome.draft.num_draft_tokens
        num_accepted = 0 if outcome is None else outcome.num_accepted_tokens
        suffix_drafted = 0 if outcome is None else outcome.num_suffix_draft_tokens
        suffix_accepted = 0 if outcome is None else outcome.num_suffix_accepted_tokens
        forced_drafted = 0 if outcome is None else outcome.num_forced_draft_tokens
        forced_accepted = 0 if outcome is None else outcome.num_forced_accepted_tokens
        # The loop keeps a prefix of the round's tokens (it may end inside it). An accepted path runs
        # through model candidates, then suffix candidates, then what a constraint forced after them.
        logprobs = verifier.take_logprobs()[: len(token_ids)]
        kept_accepted = min(num_accepted, len(token_ids))
        kept_forced = max(0, kept_accepted - (num_accepted - forced_accepted))
        kept_suffix = max(0, kept_accepted - kept_forced - (num_accepted - forced_accepted - suffix_accepted))
        self._pending.append(
            Round(
                token_ids,
                num_draft,
                kept_accepted,
                logprobs,
                kept_suffix,
                suffix_drafted,
                kept_forced,
                forced_drafted,
            )
        )
        if not self._in_round:
            self._flush()

    def _flush(self) -> None:
        """The rounds emitted since the last flush: to Redis in one append, then to the client's queue."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        verifier = self.verifier
        assert verifier is not None
        draft = self.draft.address if self.draft is not None else ""
        tokens = [token for item in pending for token in item.token_ids]
        t0 = time.perf_counter()
        running = self.router.state.append(self.session_id, tokens, target=verifier.address, draft=draft)
        self.counters.redis_s += time.perf_counter() - t0
        self.router.metrics.redis_latency.observe(time.perf_counter() - t0)
        if not running or self.cancel.is_set():
            raise Cancelled(f"session {self.session_id} was cancelled")
        for item in pending:
            self.out.put(item)

    # -- the end -----------------------------------------------------------------------------------------
    def _finish(self, finish: FinishChecker, stats: GenerationStats) -> None:
        """Cumulative stats (over every router that ran the session) and the finish go to Redis, then the
        final message to the client."""
        router, counters = self.router, self.counters
        previous, previous_extra = saved_stats(self.record.stats)
        total = add_stats(previous, stats)
        extra = {
            "rpc_bytes": counters.rpc_bytes,
            "kv_feed_bytes": counters.kv_feed_bytes,
            "num_draft_fallbacks": counters.draft_fallbacks,
            "num_prepared_proposals": counters.prepared_proposals,
            "num_target_rebuilds": counters.target_rebuilds,
            "redis_seconds": counters.redis_s,
            "draft_service_seconds": counters.draft_service_s,
            "target_service_seconds": counters.target_service_s,
        }
        extra = {k: v + previous_extra.get(k, 0) for k, v in extra.items()}
        assert finish.reason is not None
        router.state.update(
            self.session_id,
            status=SessionStatus.FINISHED,
            finish_reason=finish.reason.value,
            stats={"core": asdict(total), "extra": extra},
        )
        router.metrics.e2e_request_latency.observe(time.perf_counter() - self._start)
        shared = router.suffix_cache_for(self.record.owner)
        if shared is not None:  # this tenant's later sessions may draft from what it wrote
            shared.cache.add(shared.tenant, finish.generated)
        self._release_load()
        self.out.put(Done(finish.reason, stats_to_pb(total, **extra), finish.final_text()))

    def _fail(self, error: BaseException) -> None:
        """The error goes to the client's stream; a cancelled session leaves nothing in Redis."""
        if self.cancel.is_set() or isinstance(error, Cancelled):
            self.router.state.delete(self.session_id, tombstone=False)  # this router drove it
        self._release_load()
        if isinstance(error, SpecserveError):
            self.out.put(error)
            return
        logger.exception("generation %s failed", self.session_id, exc_info=error)
        self.out.put(SpecserveError(f"generation failed: {error!r}"))


def add_stats(previous: GenerationStats, stats: GenerationStats) -> GenerationStats:
    return GenerationStats(
        **{k: getattr(previous, k) + getattr(stats, k) for k in GenerationStats.__dataclass_fields__}
    )


def saved_stats(saved: dict) -> tuple[GenerationStats, dict]:
    """The cumulative stats a session's Redis record holds (empty for a new session)."""
    return GenerationStats(**saved.get("core", {})), dict(saved.get("extra", {}))
