"""DraftService: a thin adapter from RPCs to draft sessions, the KV mirror and the method's drafter.

With `prepare_ahead` on (DraftServiceSettings), proposals are prepared ahead: when the KV feed delivers
a commit (its chunk carries the committed tokens and the new root), the draft builds the next round's
tree at once, on the model thread, while the router is still hearing back from the target and appending
to Redis. The Propose that follows returns it if it asks for exactly that tree (same tokens and round
seed; the sampling is the session's), and builds a fresh one otherwise, so the tokens a client receives
never depend on the timing. (A tree built ahead and then not used has still taught the stop policy one
round; only adaptivity, never output, notices.)

Otherwise a session follows the target's KV feed only while its rounds draft: Propose first lets the
drafter size the round (`open_round`), and a round of the root alone (the cost policy under load) neither
waits for the mirror nor keeps the feed subscribed. The next round that drafts subscribes again and
waits for the positions committed meanwhile (services/draft/mirror.py). A round the load made the root
alone is answered in one job on the model thread, and tells the router up to how many sessions on the
target the next round would draft (`drafts_up_to_batch_sessions`), so the router need not ask meanwhile.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from services.draft.mirror import FeedSubscriber, KVMirror
from services.draft.prefix import MirrorPrefixCache, MirrorScope, PendingPrompt
from services.draft.priors import AcceptancePriors
from services.draft.sessions import DraftSession, DraftSessionStore, Proposal
from specserve.core.grammar import ConstrainedDrafter
from specserve.core.protocols import CostSizedDrafter, Drafter, KnowsPrompt, RoundOpeningDrafter
from specserve.core.rng import draft_round_seed
from specserve.errors import InvalidArgument, NotFound
from specserve.grammar import Guide
from specserve.methods import method_spec
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.runtime.prefix_cache import DraftPrefix
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK
from specserve.serving import telemetry
from specserve.serving.convert import check_session_id, constraint_from_pb, sampling_from_pb
from specserve.serving.metrics import DraftMetrics
from specserve.serving.model_thread import ModelThread
from specserve.serving.recent import RecentSessions
from specserve.serving.server import channel_options
from specserve.serving.settings import DraftServiceSettings
from specserve.serving.target_costs import PublishedCosts
from specserve.serving.tensor_convert import chunk_payload_bytes, draft_to_pb
from specserve.serving.tls import open_channel
from specserve.serving.validate import check_target_address, check_token_ids
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self,
        models: DraftRuntime,
        settings: DraftServiceSettings,
        metrics: DraftMetrics,
        model: ModelThread | None = None,  # the thread that loaded the models (serving/model_thread.py)
    ) -> None:
        self.models = models
        self.settings = settings
        self.metrics = metrics
        self.model = model or ModelThread.for_settings("draft-model", settings)  # forwards batched
        metrics.batching.attach(self.model)
        # The batch the cost policy sizes trees against: sessions that proposed within the last second
        # (a session whose round drafts nothing holds no job for long, but still shares the target), or
        # the target's own count when the router reports a larger one.
        self.recent = RecentSessions()
        self.model.scheduler.load_hint = self.recent.count
        self.store = DraftSessionStore(settings.max_sessions, run=self.model.run)
        self.priors = AcceptancePriors()  # where new sessions' cost policies start (priors.py)
        self.prefix = MirrorPrefixCache(settings.prefix_cache_bytes)  # mirrored prompt blocks (prefix.py)
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self.target_costs = PublishedCosts(
            lambda address: target_pb2_grpc.TargetServiceStub(self.channel_for(address))
        )

    def target_stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        return target_pb2_grpc.TargetServiceStub(self.channel_for(address))

    def channel_for(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                # Plain: the feed injects trace context itself (the tracing wrapper hides cancel()).
                self._channels[address] = open_channel(
                    address, self.settings, channel_options(self.settings), self.settings.tls_target_name
                )
            return self._channels[address]

    def _grammar(self, request: draft_pb2.DraftPrefillRequest) -> Guide | None:
        """The drafter's own guide through the session's constraint (None: unconstrained)."""
        constraint = constraint_from_pb(request.constraint) if request.HasField("constraint") else None
        if constraint is None:
            return None
        if not 0 < request.num_prompt_tokens <= len(request.token_ids):
            raise InvalidArgument(
                f"num_prompt_tokens must be in [1, {len(request.token_ids)}] with a constraint, "
                f"got {request.num_prompt_tokens}"
            )
        return self.models.guide(constraint, request.num_prompt_tokens)

    def Prefill(
        self, request: draft_pb2.DraftPrefillRequest, context: grpc.ServicerContext
    ) -> draft_pb2.DraftPrefillResponse:
        check_session_id(request.session_id)
        spec = method_spec(request.method)
        limits = self.models.settings
        if not request.token_ids:
            raise InvalidArgument("token_ids is empty")
        if not request.target_address:
            raise InvalidArgument("target_address is empty")
        check_target_address(request.target_address, self.settings.target_addresses)
        check_token_ids(request.token_ids, self.models.target_vocab_size)
        if not len(request.token_ids) < request.capacity <= limits.context_limit:
            raise InvalidArgument(f"capacity must be in ({len(request.token_ids)}, {limits.context_limit}]")
        sources = self.models.for_target(
            self.target_costs.of(request.target_address), self._drafts_own_prefix(request)
        )
        mirror = KVMirror(
            [], self.models.target_config.num_hidden_layers, request.capacity, torch.device(limits.device)
        )
        sampling = sampling_from_pb(request.sampling)  # the session's, for every Propose
        grammar = self._grammar(request)  # compiled first: a bad constraint leaves nothing behind
        drafter = self.model.run(spec.make_drafter, sources, request.capacity, mirror, sampling)
        if drafter is None:
            raise InvalidArgument(f"method {request.method!r} drafts nothing; the router verifies alone")
        if grammar is not None and isinstance(drafter, ConstrainedDrafter):
            drafter.constrain(grammar)
        if isinstance(drafter, KnowsPrompt) and request.num_prompt_tokens > 0:
            # Its own K/V over the prompt may be cached (over generated tokens a draft reading the
            # target reads verify forwards' K/V, not a prefill's)
            drafter.know_prompt(min(request.num_prompt_tokens, len(request.token_ids)))
        self.priors.seed(request.method, drafter)
        # The feed carries what the drafter declared it reads (a hidden-state draft asked the mirror for
        # features when built); a drafter that reads nothing of the target opens no feed at all.
        mirror.read_layers(drafter.reads.kv_layers)
        subscriber = None
        if drafter.reads.anything:
            subscriber = FeedSubscriber(
                request.session_id,
                mirror,
                request.target_address,
                self.channel_for,
                on_chunk=lambda chunk: self._on_chunk(request.session_id, chunk),
                on_resync=self.metrics.kv_feed_resyncs.inc,
                run=self.model.run,  # the mirror's tensors are written where the drafter reads them
            )
        ahead = request.HasField("request_seed") and self.settings.prepare_ahead and subscriber is not None
        request_seed = request.request_seed if ahead else None
        # The cached prefix is in the mirror before the feed starts, which then sends what follows it.
        cached, prompt_blocks = 0, None
        if subscriber is not None:
            cached, prompt_blocks = self._load_prefix(request, mirror)
        # A session preparing ahead builds from the feed's chunks, so it follows the feed from the start;
        # any other follows it from its first round that drafts.
        self.store.put(
            DraftSession(
                request.session_id,
                request.method,
                list(request.token_ids),
                drafter,
                mirror,
                subscriber,
                request_seed,
                prompt_blocks,
            )
        )
        if subscriber is not None:
            subscriber.start(follow=request_seed is not None)
        self.metrics.sessions.set(len(self.store))
        return draft_pb2.DraftPrefillResponse(cached_tokens=cached)

    def _drafts_own_prefix(
        self, request: draft_pb2.DraftPrefillRequest
    ) -> Callable[[str], DraftPrefix | None] | None:
        """Where the session's drafter keeps its own prompt K/V (its self-attention's, or a separate draft
        model's) across sessions: the service's prefix cache, in blocks of the session's tenant on the
        session's target (a draft reading the target's state computes from that target's bits), so a
        session on a cached prompt prefills none of it on the draft either. None: the cache is off, or its
        blocks do not tile the drafters' prefill chunks (runtime/prefix_cache.py, DraftBlocks)."""
        if self.prefix.budget_bytes == 0:
            return None
        cache = self.prefix.for_block(self.target_costs.block_tokens(request.target_address))
        if cache is None or DEFAULT_PREFILL_CHUNK % cache.block_tokens:
            return None
        scope = (request.tenant, request.target_address)
        on_load = self.metrics.drafter_prefix_cache_hits.inc
        return lambda draft: DraftPrefix.of(cache, draft, *scope, on_load=on_load)

    def _load_prefix(
        self, request: draft_pb2.DraftPrefillRequest, mirror: KVMirror
    ) -> tuple[int, PendingPrompt | None]:
        """The session's longest cached prefix, loaded into its mirror on the model thread (where the mirror's
        tensors are written); how many positions, and the prompt blocks to insert once mirrored."""
        if self.prefix.budget_bytes == 0:
            return 0, None
        block_tokens = self.target_costs.block_tokens(request.target_address)
        scope = MirrorScope.of(request.tenant, request.target_address, mirror)
        cached, pending = self.model.run(
            self.prefix.load, block_tokens, scope, mirror, request.token_ids, request.num_prompt_tokens
        )
        prompt_tokens = min(request.num_prompt_tokens, len(request.token_ids) - 1)
        self.metrics.observe_prefill(max(0, prompt_tokens), cached)
        return cached, pending

    def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        check_session_id(request.session_id)
        start = time.perf_counter()
        self.recent.touch(request.session_id, request.batch_sessions)
        if not math.isfinite(request.overhead_seconds) or request.overhead_seconds < 0:
            raise InvalidArgument("overhead_seconds must be a finite number >= 0")
        check_token_ids(request.new_token_ids, self.models.target_vocab_size)
        if request.target_address:
            check_target_address(request.target_address, self.settings.target_addresses)
        session = self.store.get(request.session_id)
        if not 0 <= request.from_position <= len(session.token_ids):
            raise NotFound(
                f"draft session {request.session_id!r} knows {len(session.token_ids)} tokens, the call "
                f"starts at {request.from_position}: prefill it again"
            )
        token_ids = [*session.token_ids[: request.from_position], *request.new_token_ids]
        if (
            not token_ids
            or len(token_ids) + self.models.settings.max_tree_nodes + 1 > session.mirror.capacity
        ):
            raise InvalidArgument("the session's tokens do not fit its capacity")
        if request.HasField("last_round_committed"):
            if request.last_round_committed < 1:
                raise InvalidArgument("last_round_committed counts the tokens a round committed: >= 1")
            session.last_round_committed = request.last_round_committed
        session.token_ids = token_ids
        feed = session.subscriber
        if feed is not None:
            feed.retarget(request.target_address)
        _charge_overhead(session.drafter, request.overhead_seconds)
        idle = None
        if session.request_seed is None and isinstance(session.drafter, RoundOpeningDrafter):
            idle = self.model.run(self._round_of_the_root_alone, session, token_ids, request.step_seed)
        waited = 0.0
        if feed is None:
            pass  # the drafter reads nothing of the target: nothing to wait for
        elif idle is None:  # the round drafts: it reads the target's K/V up to the root
            feed.follow()
            waited = session.mirror.wait_for(len(token_ids) - 1, self.settings.kv_wait_seconds)
        else:
            feed.pause()
        self.metrics.kv_wait.observe(waited)
        with telemetry.span(telemetry.SPAN_PROPOSE, **{telemetry.ATTR_SESSION: request.session_id}) as span:
            if idle is None:
                proposal, prepared = self.model.run(self._propose, session, token_ids, request.step_seed)
            else:
                proposal, prepared = idle.proposal, False
            span.set_attribute(telemetry.ATTR_TREE_SIZE, proposal.num_nodes)
            span.set_attribute(telemetry.ATTR_DRAFT_LENGTH, proposal.depth)
            span.set_attribute(telemetry.ATTR_PREPARED, prepared)
        self.metrics.proposals.labels("prepared" if prepared else "on_request").inc()
        self.metrics.propose_latency.observe(time.perf_counter() - start)
        response = draft_pb2.ProposeResponse(
            tree=proposal.tree,
            kv_wait_seconds=waited,
            kv_feed_bytes=session.mirror.received_bytes,
            handler_seconds=time.perf_counter() - start,
            prepared=prepared,
        )
        if idle is not None and idle.drafts_up_to is not None:
            response.drafts_up_to_batch_sessions = idle.drafts_up_to
        return response

    def _round_of_the_root_alone(
        self, session: DraftSession, token_ids: Sequence[int], round_seed: int
    ) -> IdleRound | None:
        """On the model thread: the drafter sizes the round. A round of the root alone is built here and
        now (no forward, no K/V read), with the load below which the session would draft again; None
        when the round drafts, which `_propose` builds once the mirror holds the positions."""
        with session.exclusive():
            if session.closed:
                raise NotFound(f"draft session {session.session_id!r} was released")
            assert isinstance(session.drafter, RoundOpeningDrafter)
            session.observe_committed(token_ids)
            batch_sessions = self.model.scheduler.sessions()
            if session.drafter.open_round(token_ids, batch_sessions) > 0:
                return None
            proposal = _build(session, token_ids, round_seed, batch_sessions)
            drafter = session.drafter
            # A sampled session's rounds are sized as if alone, and each round it is asked ages its
            # acceptance estimate: rounds the router skipped would leave the estimate, and so the trees
            # and the tokens drawn, other than in process. It is asked every round (drafts_up_to None).
            up_to = drafter.drafts_up_to(batch_sessions) if isinstance(drafter, CostSizedDrafter) else None
            return IdleRound(proposal, up_to)

    def _propose(
        self, session: DraftSession, token_ids: Sequence[int], round_seed: int
    ) -> tuple[Proposal, bool]:
        """On the model thread: the prepared tree if it answers this call, else a fresh one; and which."""
        with session.exclusive():
            if session.closed:
                raise NotFound(f"draft session {session.session_id!r} was released")
            prepared, session.prepared = session.prepared, None
            if prepared is not None and prepared.answers(token_ids, round_seed):
                return prepared, True
            return _build(session, token_ids, round_seed, self.model.scheduler.sessions()), False

    def _on_chunk(self, session_id: str, chunk: target_pb2.KVChunk) -> None:
        """On the session's feed thread, after the chunk is in the mirror."""
        self._observe_chunk(chunk)
        self._cache_prompt(session_id)
        try:
            self._prepare(session_id, chunk)
        except Exception:  # a failed preparation costs only time: Propose builds the tree itself
            logger.warning("preparing the next proposal of %s failed", session_id, exc_info=True)

    def _cache_prompt(self, session_id: str) -> None:
        """Inserts the session's prompt blocks once the mirror holds them (positions a later chunk never
        rewrites, so no other thread writes what this copies)."""
        session = self.store.peek(session_id)
        pending = None if session is None else session.prompt_blocks
        if session is None or pending is None or pending.done:
            return
        try:
            MirrorPrefixCache.offer(pending, session.mirror)
        except Exception:  # a block not cached costs only a later session's feed
            logger.warning("caching the prompt of %s failed", session_id, exc_info=True)
        self.metrics.prefix_cache_bytes.set(pending.cache.used_bytes)

    def _prepare(self, session_id: str, chunk: target_pb2.KVChunk) -> None:
        """Builds the next round's tree from a chunk that completes a commit (see the module doc)."""
        session = self.store.peek(session_id)
        if not chunk.HasField("root_token") or session is None:
            return
        if session.request_seed is None:
            return
        start = chunk.start_position
        known = session.token_ids
        if start > len(known) or session.mirror.length != start + chunk.num_positions:
            return  # a resync in progress: let Propose handle it
        token_ids = (*known[:start], *chunk.token_ids, chunk.root_token)
        if len(token_ids) + self.models.settings.max_tree_nodes + 1 > session.mirror.capacity:
            return
        # Exactly the seed the router's loop will send for this round (core/rng.py).
        round_seed = draft_round_seed(session.request_seed, len(token_ids))
        with telemetry.span(telemetry.SPAN_PREPARE, **{telemetry.ATTR_SESSION: session_id}) as span:
            prepared = self.model.run(self._prepare_on_model_thread, session, token_ids, round_seed)
            span.set_attribute(telemetry.ATTR_PREPARED, prepared)

    def _prepare_on_model_thread(
        self, session: DraftSession, token_ids: tuple[int, ...], round_seed: int
    ) -> bool:
        with session.exclusive():
            if session.closed or session.proposed_root >= len(token_ids) - 1:
                return False  # released, or Propose got here first and built this round's tree itself
            session.prepared = _build(session, token_ids, round_seed, self.model.scheduler.sessions())
            return True

    def Release(
        self, request: draft_pb2.DraftReleaseRequest, context: grpc.ServicerContext
    ) -> draft_pb2.DraftReleaseResponse:
        check_session_id(request.session_id)
        session = self.store.peek(request.session_id)
        released = self.store.release(request.session_id)
        if released and session is not None:
            self.priors.learn(session.method, session.drafter)  # closed: its policy no longer moves
        self.recent.forget(request.session_id)
        self.metrics.sessions.set(len(self.store))
        return draft_pb2.DraftReleaseResponse(released=released)

    def _observe_chunk(self, chunk: target_pb2.KVChunk) -> None:
        self.metrics.kv_feed_bytes.inc(chunk_payload_bytes(chunk))
        if chunk.commit_unix_seconds:
            self.metrics.kv_feed_lag.observe(max(0.0, time.time() - chunk.commit_unix_seconds))

    def close(self) -> None:
        self.store.clear()  # on the model thread, so before it stops
        self.model.close()
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


@dataclass(frozen=True)
class IdleRound:
    """A round the load made the root alone."""

    proposal: Proposal
    drafts_up_to: int | None  # ProposeResponse.drafts_up_to_batch_sessions (cost policy only)


def _build(session: DraftSession, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> Proposal:
    """On the model thread: the draft forward and the tree's sparse probabilities (torch ops), for a
    round whose target forward batch_sessions sessions share (the scheduler's count)."""
    root_position = len(token_ids) - 1
    session.observe_committed(token_ids)
    session.mirror.visible = root_position
    session.proposed_root = root_position
    draft = session.drafter.propose(list(token_ids), round_seed, batch_sessions)
    session.last_draft = draft
    tree = draft_to_pb(draft)
    return Proposal(tuple(token_ids), round_seed, tree, draft.tree.num_nodes, max(draft.tree.depths()))


def _charge_overhead(drafter: Drafter, seconds: float) -> None:
    """Tells a cost policy what asking this drafter costs the router's rounds (ProposeRequest doc)."""
    if isinstance(drafter, CostSizedDrafter):
        drafter.charge_overhead(seconds)
