"""DraftService: a thin adapter from RPCs to draft sessions, the KV mirror and the method's drafter."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc

from services.draft.mirror import FeedSubscriber, KVMirror
from services.draft.sessions import DraftSession, DraftSessionStore
from specserve.core.sampling_params import SamplingParams
from specserve.engine import Engine
from specserve.errors import InvalidArgument, NotFound
from specserve.methods import method_spec
from specserve.serving import telemetry
from specserve.serving.convert import check_session_id, sampling_from_pb
from specserve.serving.metrics import DraftMetrics
from specserve.serving.model_thread import ModelThread
from specserve.serving.server import channel_options
from specserve.serving.settings import DraftServiceSettings
from specserve.serving.tensor_convert import chunk_payload_bytes, draft_to_pb
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self,
        engine: Engine,
        settings: DraftServiceSettings,
        metrics: DraftMetrics,
        model: ModelThread | None = None,  # the thread that loaded the engine (serving/model_thread.py)
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.store = DraftSessionStore(settings.max_sessions)
        self.model = model or ModelThread("draft-model")  # every draft forward, one at a time
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()

    def channel_for(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                # Plain: the feed injects trace context itself (the tracing wrapper hides cancel()).
                self._channels[address] = grpc.insecure_channel(
                    address, options=channel_options(self.settings)
                )
            return self._channels[address]

    def Prefill(self, request: draft_pb2.DraftPrefillRequest, context: grpc.ServicerContext):
        check_session_id(request.session_id)
        spec = method_spec(request.method)
        limits = self.engine.settings
        if not request.token_ids:
            raise InvalidArgument("token_ids is empty")
        if not request.target_address:
            raise InvalidArgument("target_address is empty")
        if not len(request.token_ids) < request.capacity <= limits.max_context:
            raise InvalidArgument(f"capacity must be in ({len(request.token_ids)}, {limits.max_context}]")
        mirror = KVMirror(
            [self.engine.glide_draft.config.target_layer],
            self.engine.target_model.config.num_hidden_layers,
            request.capacity,
            self.engine.target_runner.device,
        )
        drafter = self.model.run(spec.make_drafter, self.engine, request.capacity, mirror)
        if drafter is None:
            raise InvalidArgument(f"method {request.method!r} drafts nothing; the router verifies alone")
        subscriber = FeedSubscriber(
            request.session_id,
            mirror,
            request.target_address,
            self.channel_for,
            on_chunk=self._observe_chunk,
            on_resync=self.metrics.kv_feed_resyncs.inc,
            run=self.model.run,  # the mirror's tensors are written where the drafter reads them
        )
        self.store.put(
            DraftSession(
                request.session_id, request.method, list(request.token_ids), drafter, mirror, subscriber
            )
        )
        subscriber.start()
        self.metrics.sessions.set(len(self.store))
        return draft_pb2.DraftPrefillResponse()

    def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.ServicerContext):
        check_session_id(request.session_id)
        start = time.perf_counter()
        session = self.store.get(request.session_id)
        if not 0 <= request.from_position <= len(session.token_ids):
            raise NotFound(
                f"draft session {request.session_id!r} knows {len(session.token_ids)} tokens, the call "
                f"starts at {request.from_position}: prefill it again"
            )
        token_ids = [*session.token_ids[: request.from_position], *request.new_token_ids]
        if (
            not token_ids
            or len(token_ids) + self.engine.settings.max_tree_nodes + 1 > session.mirror.capacity
        ):
            raise InvalidArgument("the session's tokens do not fit its capacity")
        session.token_ids = token_ids
        session.subscriber.retarget(request.target_address)
        params = sampling_from_pb(request.sampling).validate(self.engine.settings.max_new_tokens_limit)
        root_position = len(token_ids) - 1
        waited = session.mirror.wait_for(root_position, self.settings.kv_wait_seconds)
        self.metrics.kv_wait.observe(waited)
        with telemetry.span(telemetry.SPAN_PROPOSE, **{telemetry.ATTR_SESSION: request.session_id}) as span:
            tree, num_nodes, depth = self.model.run(
                self._propose, session, root_position, token_ids, params, request.step_seed
            )
            span.set_attribute(telemetry.ATTR_TREE_SIZE, num_nodes)
            span.set_attribute(telemetry.ATTR_DRAFT_LENGTH, depth)
        self.metrics.propose_latency.observe(time.perf_counter() - start)
        return draft_pb2.ProposeResponse(
            tree=tree,
            kv_wait_seconds=waited,
            kv_feed_bytes=session.mirror.received_bytes,
            handler_seconds=time.perf_counter() - start,
        )

    @staticmethod
    def _propose(
        session: DraftSession,
        root_position: int,
        token_ids: Sequence[int],
        params: SamplingParams,
        step_seed: int,
    ) -> tuple[common_pb2.DraftTree, int, int]:
        """On the model thread: the draft forward and the tree's sparse probabilities (torch ops)."""
        session.mirror.visible = root_position
        draft = session.drafter.propose(list(token_ids), params, step_seed)
        return draft_to_pb(draft), draft.tree.num_nodes, max(draft.tree.depths())

    def Release(self, request: draft_pb2.DraftReleaseRequest, context: grpc.ServicerContext):
        check_session_id(request.session_id)
        released = self.store.release(request.session_id)
        self.metrics.sessions.set(len(self.store))
        return draft_pb2.DraftReleaseResponse(released=released)

    def _observe_chunk(self, chunk) -> None:
        self.metrics.kv_feed_bytes.inc(chunk_payload_bytes(chunk))
        if chunk.commit_unix_seconds:
            self.metrics.kv_feed_lag.observe(max(0.0, time.time() - chunk.commit_unix_seconds))

    def close(self) -> None:
        self.model.close()
        self.store.clear()
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
