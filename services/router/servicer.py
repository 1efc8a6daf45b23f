"""RouterService: the public API. Each generation runs on a worker thread (session_run.py: the core loop
with the remote drafter and verifier); its tokens go to Redis first and then to the client's stream."""

from __future__ import annotations

import contextvars
import functools
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.router.leases import LeaseRenewer
from services.router.placement import ReplicaSet
from services.router.prefix_routing import PrefixDirectory
from services.router.remote import RoundTripMean
from services.router.session_run import Done, Round, SessionRun, saved_stats
from services.router.state import (
    SessionRecord,
    SessionState,
    SessionStatus,
    scoped_session_id,
    unknown_session,
)
from services.router.tokenizer import IncrementalText, RouterTokenizer
from specserve.catalog import CATALOG, MethodSupport
from specserve.core.prompt_indexes import PromptIndexCache, TenantPrompts
from specserve.core.request import GenerationRequest, RequestLimits
from specserve.core.suffix import SharedSuffixCache
from specserve.core.suffix_drafter import TenantCache, WorthPriors
from specserve.errors import Cancelled, InvalidArgument, ResourceExhausted
from specserve.results import FinishReason
from specserve.serving.auth import current_caller
from specserve.serving.convert import (
    check_session_id,
    finish_to_pb,
    limits_from_model_info,
    request_from_pb,
    stats_to_pb,
)
from specserve.serving.metrics import RouterMetrics
from specserve.serving.server import channel_options
from specserve.serving.settings import RouterServiceSettings
from specserve.serving.status import error_from_rpc
from specserve.serving.target_costs import PublishedCosts
from specserve.serving.telemetry import traced_channel
from specserve.serving.tls import channel_credentials, server_name_options
from specserve.serving.validate import check_prompt_chars
from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)

STREAM_POLL_SECONDS = 0.25  # how often a waiting stream checks that its client is still there


# Called with a function to run once the client has gone (disconnect, deadline): gRPC's
# context.add_callback, or the HTTP API's own registry.
OnClientGone = Callable[[Callable[[], None]], object]


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, settings: RouterServiceSettings, metrics: RouterMetrics, state: SessionState) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self.targets = ReplicaSet(settings.target_addresses, prefix_slack=settings.prefix_routing_slack)
        self.drafts = ReplicaSet(settings.draft_addresses) if settings.draft_addresses else None
        self.draft_round_trips = RoundTripMean()  # where each session's draft overhead estimate starts
        self._channels: dict[str, grpc.Channel] = {}
        self._target_stubs: dict[str, target_pb2_grpc.TargetServiceStub] = {}  # one per channel, kept
        self._lock = threading.Lock()
        self._cancel_events: dict[str, threading.Event] = {}
        # Generations run here; the server's own concurrency limit keeps this bounded.
        self._workers = ThreadPoolExecutor(settings.max_concurrent_rpcs, thread_name_prefix="generation")
        self._model: tuple[target_pb2.ModelInfo, RouterTokenizer] | None = None
        self._model_lock = threading.Lock()
        self._suffix_cache = (
            SharedSuffixCache(settings.suffix_cache_tenants, max(settings.suffix_cache_tokens, 8))
            if settings.suffix_cache_tokens > 0
            else None
        )
        # What model drafts earned in this router's earlier sessions: timings and counts, no text.
        self.worth_priors = WorthPriors()
        # The suffix indexes of prompts, per tenant: a session indexes only what its tenant had not sent.
        self._prompt_indexes = (
            PromptIndexCache(settings.prompt_index_cache_tokens, on_start=metrics.count_prompt_index)
            if settings.prompt_index_cache_tokens > 0
            else None
        )
        # Each target replica's published verify curve: greedy sessions' suffix candidates are sized by it.
        self.target_costs = PublishedCosts(self.target_stub)
        # Keeps the sessions this router drives alive on their target and draft (leases.py).
        replicas = [(self.targets, lambda a: self._channel(a, settings.tls_target_name))]
        if self.drafts is not None:
            replicas.append((self.drafts, self.draft_channel))
        self.leases = LeaseRenewer(replicas).start()

    def suffix_cache_for(self, owner: str) -> TenantCache | None:
        """The recent outputs a session of `owner` (a principal, "" without auth) may draft from: its
        tenant's only, and none without auth unless sharing among all callers was asked for."""
        if self._suffix_cache is None or not (owner or self.settings.share_outputs_without_auth):
            return None
        return TenantCache(self._suffix_cache, owner)

    def prompt_indexes_for(self, owner: str) -> TenantPrompts | None:
        """The prompt indexes a session of `owner` may start from: its tenant's only. Without auth every
        caller is one tenant, as for the targets' prefix caches: an index is the one the caller's own
        prompt gives, so sharing it tells nothing but the time it saves."""
        return None if self._prompt_indexes is None else TenantPrompts(self._prompt_indexes, owner)

    def _model_info(self) -> tuple[target_pb2.ModelInfo, RouterTokenizer]:
        """Fetched from a target on first use (targets may start after the router)."""
        with self._model_lock:
            if self._model is None:
                address = self.targets.choose("model-info")
                try:
                    info = self.target_stub(address).GetModelInfo(
                        target_pb2.GetModelInfoRequest(), timeout=self.settings.target_timeout_seconds
                    )
                except grpc.RpcError as e:
                    raise error_from_rpc(e, f"target {address} GetModelInfo") from None
                self._model = (info, RouterTokenizer(info))
            return self._model

    @property
    def model(self) -> target_pb2.ModelInfo:
        return self._model_info()[0]

    @functools.cached_property
    def prefix_directory(self) -> PrefixDirectory | None:
        """Where this router sent prompts' blocks; None when prefix routing is off, there is one target
        entry or the targets keep no prefix cache."""
        block_tokens = self.model.prefix_cache_block_tokens
        wanted = self.settings.prefix_routing and len(self.settings.target_addresses) > 1
        return PrefixDirectory(block_tokens) if wanted and block_tokens > 0 else None

    @property
    def tokenizer(self) -> RouterTokenizer:
        return self._model_info()[1]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.model.eos_token_ids)

    # -- channels -----------------------------------------------------------------------------------
    def _channel(self, address: str, server_name: str = "") -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                credentials = channel_credentials(self.settings)
                options = channel_options(self.settings)
                if credentials is not None:
                    options += server_name_options(server_name)
                self._channels[address] = traced_channel(address, options, credentials)
            return self._channels[address]

    def target_stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        """The stub of the router's channel to a target (channels are kept for the router's life, and a
        stub made per call costs a multi-callable per method each round)."""
        stub = self._target_stubs.get(address)
        if stub is None:
            channel = self._channel(address, self.settings.tls_target_name)
            stub = self._target_stubs.setdefault(address, target_pb2_grpc.TargetServiceStub(channel))
        return stub

    def draft_channel(self, address: str) -> grpc.Channel:
        return self._channel(address, self.settings.tls_draft_name)

    # -- RPCs ---------------------------------------------------------------------------------------
    @property
    def method_support(self) -> MethodSupport:
        """The methods this router runs: remote ones, and those with a draft model only with a draft
        service; named or by their axes."""
        return MethodSupport(in_process=False, draft_models=self.drafts is not None)

    @property
    def methods(self) -> frozenset[str]:
        """The catalog names among them."""
        return frozenset(self.method_support.names())

    @property
    def limits(self) -> RequestLimits:
        """What a request may ask of this router (GenerationRequest.build checks it)."""
        return limits_from_model_info(self.model, self.method_support)

    def default_max_new_tokens(self, num_prompt_tokens: int) -> int:
        """A request's new-token limit when it names none: the router's default_max_tokens, at most the
        server's limit and what the context leaves after the prompt (at least 1: a prompt that leaves no
        room is then refused with the context's message)."""
        info = self.model
        room = info.max_context - info.max_tree_nodes - 1 - num_prompt_tokens
        return max(1, min(self.settings.default_max_tokens, info.max_new_tokens_limit, room))

    def ListMethods(
        self, request: router_pb2.ListMethodsRequest, context: grpc.ServicerContext
    ) -> router_pb2.ListMethodsResponse:
        return router_pb2.ListMethodsResponse(
            methods=[
                router_pb2.MethodInfo(name=i.name, description=i.description, lossless=i.lossless)
                for i in CATALOG.values()
                if self.method_support.runs(i)
            ]
        )

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        prompt_ids = self._prompt_ids(request)
        default_max_new_tokens = self.default_max_new_tokens(len(prompt_ids))
        generation = request_from_pb(
            request, prompt_ids, self.limits, self.settings.default_method, default_max_new_tokens
        )
        record = self.start_session(generation, prompt_ids, request.session_id)
        yield from self.stream_session(record, context.add_callback)

    def start_session(
        self, request: GenerationRequest, prompt_ids: list[int], session_id: str = ""
    ) -> SessionRecord:
        """Stores a new session of a request validated against `limits`; its seed is fixed here. The
        HTTP API starts sessions here too. A constraint is compiled first (then cached for the session's
        run), so one that does not compile is refused before anything is stored."""
        public_id = check_session_id(session_id) if session_id else uuid.uuid4().hex
        if request.constraint is not None:
            self.tokenizer.grammar_compiler.compile(request.constraint)
        owner = current_caller()
        record = SessionRecord(
            scoped_session_id(owner, public_id),
            prompt_ids,
            request.with_seed(),
            owner=owner,
            public_id=public_id,
        )
        self.state.create(record)
        return record

    def load_own(self, session_id: str) -> tuple[SessionRecord, list[int]]:
        """The caller's session of that id and its tokens; NotFound, the same for every caller, if the
        caller has none (another tenant's session of that id is stored under another key)."""
        check_session_id(session_id)
        owner = current_caller()
        record, generated = self.state.load(scoped_session_id(owner, session_id), session_id)
        if record.owner != owner:  # a record from before tenants were scoped (none without auth)
            raise unknown_session(session_id)
        return record, generated

    def stream_session(
        self, record: SessionRecord, on_client_gone: OnClientGone
    ) -> Iterator[router_pb2.GenerateResponse]:
        """A new session's stream, one message per round (with log-probabilities if it asked)."""
        return self._stream(record, [], 0, on_client_gone, record.request.num_top_logprobs)

    def Resume(
        self, request: router_pb2.ResumeRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        yield from self.resume_session(request.session_id, request.received_tokens, context.add_callback)

    def resume_session(
        self, session_id: str, received_tokens: int, on_client_gone: OnClientGone
    ) -> Iterator[router_pb2.GenerateResponse]:
        """The caller's session `session_id` streamed from token `received_tokens` on, continuing its
        generation if it is still running (on this router or one that died). The HTTP API resumes here."""
        record, generated = self.load_own(session_id)
        if not 0 <= received_tokens <= len(generated):
            raise InvalidArgument(f"received_tokens must be in [0, {len(generated)}]")
        if record.status == SessionStatus.RUNNING:  # two routers never drive one session
            self.state.take_lease(record.session_id)
            record, generated = self.state.load(record.session_id, session_id)  # what the last holder wrote
        return self._stream(record, generated, received_tokens, on_client_gone)

    def Cancel(
        self, request: router_pb2.CancelRequest, context: grpc.ServicerContext
    ) -> router_pb2.CancelResponse:
        session_id = self.load_own(request.session_id)[0].session_id  # NOT_FOUND for unknown ids
        # Deleting the state is the cancellation: whichever router runs the session finds it gone at its
        # next round, stops, and releases the draft and target sessions.
        self.state.delete(session_id)
        with self._lock:
            event = self._cancel_events.get(session_id)
        if event is not None:
            event.set()
        return router_pb2.CancelResponse()

    # -- generation -----------------------------------------------------------------------------------
    def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's tokens: the user message through the chat template, or the ids as given."""
        if bool(request.prompt) == bool(request.prompt_token_ids):
            raise InvalidArgument("set exactly one of prompt and prompt_token_ids")
        if not request.prompt:
            return list(request.prompt_token_ids)
        check_prompt_chars(request.prompt, self.model.max_prompt_tokens, self.tokenizer.max_token_chars)
        return self.tokenizer.encode_prompt(request.prompt)

    def _stream(
        self,
        record: SessionRecord,
        generated: list[int],
        received: int,
        on_client_gone: OnClientGone,
        logprobs: int | None = None,
    ) -> Iterator[router_pb2.GenerateResponse]:
        session_id, public_id = record.session_id, record.public_id  # the responses carry the caller's id
        cancel = threading.Event()
        with self._lock:
            if session_id in self._cancel_events:
                raise InvalidArgument(f"session {public_id!r} is already streaming on this router")
            self._cancel_events[session_id] = cancel
        on_client_gone(cancel.set)  # the client went away or its deadline passed
        out: queue.Queue = queue.Queue()
        # The streamed text never shows a stop string, not even the start of one (it may yet be one).
        text = IncrementalText(self.tokenizer, generated[:received], record.request.stopping.stop)
        index = received
        try:
            if generated[received:]:
                out.put(list(generated[received:]))
            if record.status != SessionStatus.FINISHED:
                try:
                    # In the RPC's context, so the worker's spans join the caller's trace (a pool
                    # thread does not inherit context variables).
                    worker_context = contextvars.copy_context()
                    run = SessionRun(self, record, generated, out, cancel, logprobs)
                    self._workers.submit(worker_context.run, run.run)
                except RuntimeError:
                    raise ResourceExhausted("the router is shutting down") from None
            else:
                saved, saved_extra = saved_stats(record.stats)
                stats = stats_to_pb(saved, **saved_extra)
                out.put(Done(FinishReason(record.finish_reason), stats, self.tokenizer.decode(generated)))
            while True:
                try:
                    item = out.get(timeout=STREAM_POLL_SECONDS)
                except queue.Empty:
                    if cancel.is_set():  # Cancel RPC (a client that went away gets nothing)
                        yield self._cancelled(public_id, index)
                        return
                    continue
                if isinstance(item, Cancelled):
                    yield self._cancelled(public_id, index)
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Done):
                    yield router_pb2.GenerateResponse(
                        session_id=public_id,
                        index=index,
                        text=text.add([], final_text=item.text),
                        finish_reason=finish_to_pb(item.reason),
                        stats=item.stats,
                    )
                    return
                if isinstance(item, Round):
                    yield router_pb2.GenerateResponse(
                        session_id=public_id,
                        token_ids=item.token_ids,
                        index=index,
                        text=text.add(item.token_ids),
                        round=router_pb2.RoundInfo(
                            index=index,
                            num_draft_tokens=item.num_draft_tokens,
                            num_accepted_tokens=item.num_accepted_tokens,
                            num_suffix_accepted_tokens=item.num_suffix_accepted_tokens,
                            num_suffix_draft_tokens=item.num_suffix_draft_tokens,
                            num_forced_draft_tokens=item.num_forced_draft_tokens,
                            num_forced_accepted_tokens=item.num_forced_accepted_tokens,
                        ),
                        logprobs=item.logprobs,
                    )
                    index += len(item.token_ids)
                    continue
                yield router_pb2.GenerateResponse(  # tokens generated before a Resume
                    session_id=public_id, token_ids=item, index=index, text=text.add(item)
                )
                index += len(item)
        finally:
            cancel.set()  # no-op after a normal finish: the worker has already returned
            with self._lock:
                self._cancel_events.pop(session_id, None)

    @staticmethod
    def _cancelled(session_id: str, index: int) -> router_pb2.GenerateResponse:
        return router_pb2.GenerateResponse(
            session_id=session_id, index=index, finish_reason=common_pb2.FINISH_REASON_CANCELLED
        )

    def close(self) -> None:
        self.leases.close()
        for event in list(self._cancel_events.values()):
            event.set()
        self._workers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
        self.state.close()
