"""RouterService: the public API. Each generation runs the core loop on a worker thread with the remote
drafter and verifier; its tokens go to Redis first and then to the client's stream."""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import grpc

from services.router.placement import ReplicaSet
from services.router.remote import RemoteDrafter, RemoteVerifier, RoundCounters
from services.router.state import SessionRecord, SessionState, SessionStatus
from services.router.tokenizer import IncrementalText, RouterTokenizer
from specserve.catalog import CATALOG, Method
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.request import GenerationRequest, RequestLimits
from specserve.errors import InvalidArgument, ResourceExhausted, SpecserveError
from specserve.results import FinishReason, GenerationStats
from specserve.serving import telemetry
from specserve.serving.auth import check_owner, current_caller
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
from specserve.serving.status import Cancelled, error_from_rpc
from specserve.serving.telemetry import traced_channel
from specserve.serving.tls import channel_credentials, server_name_options
from specserve.serving.validate import check_prompt_chars
from specserve.v1 import common_pb2, draft_pb2_grpc, router_pb2, router_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)

STREAM_POLL_SECONDS = 0.25  # how often a waiting stream checks that its client is still there


@dataclass
class _Done:
    reason: FinishReason
    stats: router_pb2.GenerationStats
    text: str  # the finished text (cut before a stop string)


@dataclass
class _Round:
    """One round's tokens as the worker hands them to the stream."""

    token_ids: list[int]
    num_draft_tokens: int
    num_accepted_tokens: int  # the first this many of token_ids came from the draft
    logprobs: list[common_pb2.TokenLogprob]


# Called with a function to run once the client has gone (disconnect, deadline): gRPC's
# context.add_callback, or the HTTP API's own registry.
OnClientGone = Callable[[Callable[[], None]], object]


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, settings: RouterServiceSettings, metrics: RouterMetrics, state: SessionState) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self.targets = ReplicaSet(settings.target_addresses)
        self.drafts = ReplicaSet(settings.draft_addresses) if settings.draft_addresses else None
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._cancel_events: dict[str, threading.Event] = {}
        # Generations run here; the server's own concurrency limit keeps this bounded.
        self._workers = ThreadPoolExecutor(settings.max_concurrent_rpcs, thread_name_prefix="generation")
        self._model: tuple[target_pb2.ModelInfo, RouterTokenizer] | None = None
        self._model_lock = threading.Lock()

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
        return target_pb2_grpc.TargetServiceStub(self._channel(address, self.settings.tls_target_name))

    # -- RPCs ---------------------------------------------------------------------------------------
    @property
    def methods(self) -> frozenset[str]:
        """The methods this router runs: remote ones, and those that draft only with a draft service."""
        return frozenset(
            i.method.value
            for i in CATALOG.values()
            if i.remote and not i.uses_hf_generate and (self.drafts is not None or not i.drafts)
        )

    @property
    def limits(self) -> RequestLimits:
        """What a request may ask of this router (GenerationRequest.build checks it)."""
        return limits_from_model_info(self.model, self.methods)

    def ListMethods(
        self, request: router_pb2.ListMethodsRequest, context: grpc.ServicerContext
    ) -> router_pb2.ListMethodsResponse:
        return router_pb2.ListMethodsResponse(
            methods=[
                router_pb2.MethodInfo(name=i.method.value, description=i.description, lossless=i.lossless)
                for i in CATALOG.values()
                if i.method.value in self.methods
            ]
        )

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        prompt_ids = self._prompt_ids(request)
        generation = request_from_pb(request, prompt_ids, self.limits, self.settings.default_method)
        record = self.start_session(generation, prompt_ids, request.session_id)
        yield from self.stream_session(record, context.add_callback)

    def start_session(
        self, request: GenerationRequest, prompt_ids: list[int], session_id: str = ""
    ) -> SessionRecord:
        """Stores a new session of a request validated against `limits`; its seed is fixed here. The
        HTTP API starts sessions here too."""
        session_id = check_session_id(session_id) if session_id else uuid.uuid4().hex
        record = SessionRecord(session_id, prompt_ids, request.with_seed(), owner=current_caller())
        self.state.create(record)
        return record

    def stream_session(
        self, record: SessionRecord, on_client_gone: OnClientGone
    ) -> Iterator[router_pb2.GenerateResponse]:
        """A new session's stream, one message per round (with log-probabilities if it asked)."""
        return self._stream(record, [], 0, on_client_gone, record.request.num_top_logprobs)

    def Resume(
        self, request: router_pb2.ResumeRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        check_session_id(request.session_id)
        record, generated = self.state.load(request.session_id)
        check_owner(record.owner)
        if not 0 <= request.received_tokens <= len(generated):
            raise InvalidArgument(f"received_tokens must be in [0, {len(generated)}]")
        if record.status == SessionStatus.RUNNING:  # two routers never drive one session
            self.state.take_lease(request.session_id)
            record, generated = self.state.load(request.session_id)  # what the last holder wrote
        yield from self._stream(record, generated, request.received_tokens, context.add_callback)

    def Cancel(
        self, request: router_pb2.CancelRequest, context: grpc.ServicerContext
    ) -> router_pb2.CancelResponse:
        check_session_id(request.session_id)
        check_owner(self.state.load(request.session_id)[0].owner)  # NOT_FOUND for unknown ids
        # Deleting the state is the cancellation: whichever router runs the session finds it gone at its
        # next round, stops, and releases the draft and target sessions.
        self.state.delete(request.session_id)
        with self._lock:
            event = self._cancel_events.get(request.session_id)
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
        session_id = record.session_id
        cancel = threading.Event()
        with self._lock:
            if session_id in self._cancel_events:
                raise InvalidArgument(f"session {session_id!r} is already streaming on this router")
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
                    self._workers.submit(
                        worker_context.run, self._generate, record, generated, out, cancel, logprobs
                    )
                except RuntimeError:
                    raise ResourceExhausted("the router is shutting down") from None
            else:
                saved, saved_extra = _saved_stats(record.stats)
                stats = stats_to_pb(saved, **saved_extra)
                out.put(_Done(FinishReason(record.finish_reason), stats, self.tokenizer.decode(generated)))
            while True:
                try:
                    item = out.get(timeout=STREAM_POLL_SECONDS)
                except queue.Empty:
                    if cancel.is_set():  # Cancel RPC (a client that went away gets nothing)
                        yield self._cancelled(session_id, index)
                        return
                    continue
                if isinstance(item, Cancelled):
                    yield self._cancelled(session_id, index)
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Done):
                    yield router_pb2.GenerateResponse(
                        session_id=session_id,
                        index=index,
                        text=text.add([], final_text=item.text),
                        finish_reason=finish_to_pb(item.reason),
                        stats=item.stats,
                    )
                    return
                if isinstance(item, _Round):
                    yield router_pb2.GenerateResponse(
                        session_id=session_id,
                        token_ids=item.token_ids,
                        index=index,
                        text=text.add(item.token_ids),
                        round=router_pb2.RoundInfo(
                            index=index,
                            num_draft_tokens=item.num_draft_tokens,
                            num_accepted_tokens=item.num_accepted_tokens,
                        ),
                        logprobs=item.logprobs,
                    )
                    index += len(item.token_ids)
                    continue
                yield router_pb2.GenerateResponse(  # tokens generated before a Resume
                    session_id=session_id, token_ids=item, index=index, text=text.add(item)
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

    def _generate(
        self,
        record: SessionRecord,
        generated: list[int],
        out: queue.Queue,
        cancel: threading.Event,
        logprobs: int | None = None,
    ) -> None:
        """Runs on a worker thread until the session finishes, fails or is cancelled."""
        session_id, request = record.session_id, record.request
        assert request.seed is not None, "a session's seed is fixed when it starts"
        capacity = self.limits.capacity(len(record.prompt_ids), request.stopping.max_new_tokens)
        counters = RoundCounters()
        # (draft tokens, accepted draft tokens) of the round the loop is about to emit; the prefill's
        # first token is a round without a draft.
        this_round = [(0, 0)]

        def on_round(num_draft: int, num_accepted: int, verify_s: float, round_bytes: int) -> None:
            this_round[0] = (num_draft, num_accepted)
            self.metrics.observe_round(num_draft, num_accepted, verify_s, round_bytes)

        target_address = self.targets.choose(session_id, record.target)
        self.targets.acquire(target_address)
        verifier = RemoteVerifier(
            session_id,
            self.target_stub,
            lambda: self.targets.choose(session_id, record.target),
            self.targets.mark_failed,
            request.sampling,
            capacity,
            self.settings.target_timeout_seconds,
            counters,
            is_cancelled=cancel.is_set,
            on_round=on_round,
            logprobs=logprobs,
        )
        verifier.address = target_address
        drafter = None
        draft_address = ""
        if CATALOG[Method(request.method)].drafts and self.drafts is not None:
            draft_address = self.drafts.choose(session_id, record.draft)
            self.drafts.acquire(draft_address)
            drafter = RemoteDrafter(
                session_id,
                request.method,
                draft_pb2_grpc.DraftServiceStub(self._channel(draft_address, self.settings.tls_draft_name)),
                lambda: verifier.address,
                request.sampling,
                capacity,
                self.settings.draft_timeout_seconds,
                counters,
                on_propose=self.metrics.draft_rpc_latency.observe,
                request_seed=request.seed,
                batch_sessions=lambda: verifier.batch_sessions,
            )
        previous, previous_extra = _saved_stats(record.stats)
        finish = FinishChecker.for_request(request.stopping, self.eos_token_ids, self.tokenizer.decode)
        start = time.perf_counter()
        last_emit = [start]
        first = [not generated]
        self.metrics.running_requests.inc()

        def on_tokens(token_ids: list[int]) -> None:
            now = time.perf_counter()
            if first[0]:
                self.metrics.time_to_first_token.observe(now - start)
                first[0] = False
            else:
                self.metrics.inter_token_latency.observe((now - last_emit[0]) / len(token_ids))
            last_emit[0] = now
            t0 = time.perf_counter()
            running = self.state.append(session_id, token_ids, target=verifier.address, draft=draft_address)
            counters.redis_s += time.perf_counter() - t0
            self.metrics.redis_latency.observe(time.perf_counter() - t0)
            if not running or cancel.is_set():
                raise Cancelled(f"session {session_id} was cancelled")
            num_draft, num_accepted = this_round[0]
            this_round[0] = (0, 0)
            # The loop keeps a prefix of the round's tokens (it may end inside it).
            round_logprobs = verifier.take_logprobs()[: len(token_ids)]
            out.put(_Round(token_ids, num_draft, min(num_accepted, len(token_ids)), round_logprobs))

        def round_scope(position: int):
            return telemetry.span(
                telemetry.SPAN_ROUND, **{telemetry.ATTR_SESSION: session_id, "specserve.position": position}
            )

        try:
            with telemetry.span(
                telemetry.SPAN_REQUEST,
                **{telemetry.ATTR_SESSION: session_id, telemetry.ATTR_METHOD: request.method},
            ):
                stats = speculative_generate(
                    record.prompt_ids,
                    verifier,
                    drafter,
                    request.seed,
                    finish,
                    on_tokens,
                    generated_ids=generated,
                    round_scope=round_scope,
                )
            total = _add_stats(previous, stats)
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
            stats_pb = stats_to_pb(total, **extra)
            assert finish.reason is not None
            self.state.update(
                session_id,
                status=SessionStatus.FINISHED,
                finish_reason=finish.reason.value,
                stats={"core": asdict(total), "extra": extra},
            )
            text = finish.final_text()
            self.metrics.e2e_request_latency.observe(time.perf_counter() - start)
            out.put(_Done(finish.reason, stats_pb, text))
        except BaseException as e:
            if cancel.is_set() or isinstance(e, Cancelled):
                self.state.delete(session_id, tombstone=False)  # this router drove it: nothing stays
            out.put(e if isinstance(e, SpecserveError) else SpecserveError(f"generation failed: {e!r}"))
            if not isinstance(e, SpecserveError):
                logger.exception("generation %s failed", session_id)
        finally:
            self.state.release_lease(session_id)
            self.metrics.running_requests.dec()
            self.metrics.draft_fallbacks.inc(counters.draft_fallbacks)
            self.metrics.target_rebuilds.inc(counters.target_rebuilds)
            verifier.release()
            self.targets.release(target_address)
            if drafter is not None:
                drafter.release()
            if self.drafts is not None and draft_address:  # acquired above
                self.drafts.release(draft_address)

    def close(self) -> None:
        for event in list(self._cancel_events.values()):
            event.set()
        self._workers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
        self.state.close()


def _add_stats(previous: GenerationStats, stats: GenerationStats) -> GenerationStats:
    return GenerationStats(
        **{k: getattr(previous, k) + getattr(stats, k) for k in GenerationStats.__dataclass_fields__}
    )


def _saved_stats(saved: dict) -> tuple[GenerationStats, dict]:
    """The cumulative stats a session's Redis record holds (empty for a new session)."""
    return GenerationStats(**saved.get("core", {})), dict(saved.get("extra", {}))
