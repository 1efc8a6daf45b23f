"""TargetService: a thin adapter from RPCs to the session store and the in-process verifier."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc

from services.target.feed import kv_feed
from services.target.sessions import SessionStore, TargetSession
from specserve.core.ahead import Round, run_ahead
from specserve.core.backoff import MAX_SKIPPED_ROUNDS
from specserve.core.cost import CostModel
from specserve.core.logprobs import path_logprobs, token_logprobs
from specserve.core.protocols import MAX_AHEAD_ROUNDS, AheadPlan, DraftTree, SuffixTrust, VerifyOutcome
from specserve.core.request import MAX_TOP_LOGPROBS
from specserve.core.sampling_params import GREEDY
from specserve.core.suffix_drafter import suffix_drafter
from specserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specserve.grammar import Guide
from specserve.results import TokenLogprob
from specserve.runtime.target_runtime import TargetRuntime
from specserve.serving import telemetry
from specserve.serving.convert import (
    check_session_id,
    constraint_from_pb,
    costs_to_pb,
    logprobs_to_pb,
    sampling_from_pb,
    suffix_trust_from_pb,
    suffix_trust_to_pb,
    tree_from_pb,
    tree_to_pb,
)
from specserve.serving.metrics import TargetMetrics
from specserve.serving.model_thread import ModelThread
from specserve.serving.recent import RecentSessions
from specserve.serving.settings import TargetServiceSettings
from specserve.serving.tensor_convert import chunk_payload_bytes, with_dense_probs
from specserve.serving.validate import check_rebuild, check_token_ids
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

R = TypeVar("R")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        models: TargetRuntime,
        settings: TargetServiceSettings,
        metrics: TargetMetrics,
        model: ModelThread | None = None,  # the thread that loaded the models (serving/model_thread.py)
    ) -> None:
        self.models = models
        self.settings = settings
        self.metrics = metrics
        self.store = SessionStore(
            models.target_runner,
            settings.max_sessions,
            settings.kv_budget_tokens,
            on_evict=metrics.evictions.inc,
            reserve=models.settings.max_tree_nodes + 1,
            prefill_chunk=settings.prefill_chunk_tokens,
            prefix_cache_bytes=settings.prefix_cache_bytes,
        )
        self.model = model or ModelThread.for_settings("target-model", settings)
        metrics.batching.attach(self.model)
        self.recent = RecentSessions()  # sessions verifying here: reported back as the batch they share
        self.model.expected_jobs = self.recent.count  # a forward may wait for them (batch_wait_ms)

    def GetModelInfo(
        self, request: target_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> target_pb2.ModelInfo:
        tokenizer, limits = self.models.tokenizer, self.models.settings
        return target_pb2.ModelInfo(
            model_name=Path(self.models.model_dir).name,
            vocab_size=self.models.target_model.config.vocab_size,
            eos_token_ids=sorted(self.models.eos_token_ids),
            tokenizer_json=tokenizer.backend_tokenizer.to_str(),
            chat_template=tokenizer.chat_template or "",
            max_context=limits.context_limit,
            max_prompt_tokens=limits.prompt_limit,
            max_new_tokens_limit=limits.max_new_tokens_limit,
            max_tree_nodes=limits.max_tree_nodes,
            supports_logprobs=True,
            num_layers=self.models.target_model.config.num_hidden_layers,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            costs=costs_to_pb(self.models.verify_points, self.models.costs_version),
            prefix_cache_block_tokens=self._prefix_cache_block_tokens,
        )

    @property
    def _prefix_cache_block_tokens(self) -> int:
        """The cache's block size, 0 without a cache. `is None`, not truthiness: an empty cache has no
        blocks (len 0) yet is on, and a router asks before anything was cached (it routes by this)."""
        cache = self.store.prefix_cache
        return 0 if cache is None else cache.block_tokens

    def _guide(self, request: target_pb2.PrefillRequest, rebuild: bool) -> Guide | None:
        """The session's guide through its constraint (None: unconstrained). A rebuild replays the tokens
        generated after the prompt's num_prompt_tokens."""
        if not request.HasField("constraint"):
            return None
        constraint = constraint_from_pb(request.constraint)
        if constraint is None:
            return None
        num_prompt = len(request.token_ids)
        if rebuild:
            num_prompt = request.num_prompt_tokens
            if not 0 < num_prompt <= len(request.token_ids):
                raise InvalidArgument(
                    f"num_prompt_tokens must be in [1, {len(request.token_ids)}] for a constrained rebuild, "
                    f"got {num_prompt}"
                )
        return self.models.guide(constraint, num_prompt)

    def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> target_pb2.PrefillResponse:
        check_session_id(request.session_id)
        limits = self.models.settings
        if not request.token_ids:
            raise InvalidArgument("token_ids is empty")
        if not 0 < request.capacity <= limits.context_limit:
            raise InvalidArgument(f"capacity must be in [1, {limits.context_limit}], got {request.capacity}")
        if len(request.token_ids) + 1 + limits.max_tree_nodes > request.capacity:
            raise InvalidArgument("capacity is too small for token_ids plus one draft tree")
        vocab = self.models.target_model.config.vocab_size
        check_token_ids(request.token_ids, vocab)
        if request.HasField("root_token"):
            held = self.store.peek(request.session_id)
            committed = None if held is None else held.verifier.token_ids
            check_rebuild(request.token_ids, request.root_token, vocab, committed)
        sampling = sampling_from_pb(request.sampling)  # the session's, for every Verify
        rebuild = request.HasField("root_token")
        guide = self._guide(request, rebuild)  # compiled before any state changes: a bad one is refused
        start = time.perf_counter()
        with (
            self.store.lock,
            telemetry.span(telemetry.SPAN_PREFILL, **{telemetry.ATTR_SESSION: request.session_id}),
        ):
            session = self.store.create(
                request.session_id,
                request.capacity,
                len(request.token_ids) + 1,
                sampling,
                request.tenant,
                guide,
            )
            if request.keep_hidden_states:
                session.verifier.cache.keep_features(self.models.eagle_feature_layers)
            session.in_flight += 1
        try:
            if rebuild:
                history = [*request.token_ids, request.root_token]
                self._run(context, session.verifier.resume, history)
                next_token = request.root_token
            else:
                num_top = _top_logprobs(request.logprobs, request.top_logprobs)
                next_token, logprobs = self._run(
                    context,
                    self._prefill,
                    session,
                    list(request.token_ids),
                    request.step_seed,
                    num_top,
                )
        except Exception:
            self.store.release_if_current(session)  # never leave a half-built session behind
            raise
        finally:
            self._done(session)
        self.metrics.prefill_latency.observe(time.perf_counter() - start)
        cached = session.verifier.cached_tokens
        self.metrics.observe_prefill(len(request.token_ids), cached)
        self.recent.touch(request.session_id)  # its first Verify follows
        response = target_pb2.PrefillResponse(
            next_token=next_token,
            committed_length=session.committed_length,
            batch_sessions=self.recent.count(),
            cached_tokens=cached,
        )
        if not rebuild and logprobs:
            response.logprob.CopyFrom(logprobs_to_pb(logprobs)[0])
        return response

    @staticmethod
    def _prefill(
        session: TargetSession, prompt_ids: list[int], round_seed: int, num_top: int | None
    ) -> tuple[int, list[TokenLogprob]]:
        """On the model thread: the prompt's forward, the first token, and its log-probability if asked."""
        verifier = session.verifier
        verifier.keep_logits = num_top is not None
        root = verifier.prefill(prompt_ids, round_seed)
        logprobs: list[TokenLogprob] = []
        if num_top is not None and verifier.last_logits is not None:
            logprobs = token_logprobs(verifier.last_logits[None], [0], [root], num_top)
        verifier.last_logits = None
        return root, logprobs

    def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.ServicerContext
    ) -> target_pb2.VerifyResponse:
        check_session_id(request.session_id)
        limits = self.models.settings
        draft = tree_from_pb(request.tree, limits.max_tree_nodes + 1)
        check_token_ids(draft.tree.token_ids, self.models.target_model.config.vocab_size, "tree token ids")
        num_top = _top_logprobs(request.logprobs, request.top_logprobs)
        ahead = _ahead_plan(request, draft.tree.num_nodes, limits.max_tree_nodes + 1)
        start = time.perf_counter()
        with self.store.lock:
            session = self.store.get(request.session_id)
            if ahead.total and (
                num_top is not None
                or not session.verifier.sampling.greedy
                or session.verifier.guide is not None
            ):
                raise InvalidArgument(
                    "ahead_rounds needs a greedy session without a constraint and without logprobs"
                )
            self.recent.touch(request.session_id)
            if request.committed_length != session.committed_length + 1:
                raise FailedPrecondition(
                    f"router expects {request.committed_length} committed tokens, the target has "
                    f"{session.committed_length + 1} (including the root)"
                )
            end = session.committed_length + draft.tree.num_nodes
            if end > session.capacity:
                raise InvalidArgument("the tree does not fit the session's reserved capacity")
            if session.in_flight:
                raise FailedPrecondition("a request of this session is already running")
            session.in_flight += 1
        try:
            with self.store.lock:
                self.store.admit(session, end)
            with telemetry.span(
                telemetry.SPAN_VERIFY,
                **{
                    telemetry.ATTR_SESSION: request.session_id,
                    telemetry.ATTR_TREE_SIZE: draft.tree.num_nodes,
                },
            ) as span:
                outcome, logprobs, rounds, account = self._run(
                    context,
                    self._verify,
                    session,
                    draft,
                    request.tree,
                    request.step_seed,
                    num_top,
                    ahead,
                    request.ahead_max_tokens,
                    start + request.ahead_max_seconds if request.ahead_max_seconds else math.inf,
                )
                span.set_attribute(telemetry.ATTR_ACCEPTED_LENGTH, len(outcome.accepted_nodes) - 1)
                span.set_attribute(telemetry.ATTR_AHEAD_ROUNDS, len(rounds))
        finally:
            self._done(session)
        handler_seconds = time.perf_counter() - start
        self.metrics.verify_latency.observe(handler_seconds)
        return target_pb2.VerifyResponse(
            handler_seconds=handler_seconds,
            accepted_nodes=outcome.accepted_nodes,
            next_token=outcome.next_token,
            committed_length=session.committed_length + 1,
            logprobs=logprobs_to_pb(logprobs),
            batch_sessions=self.recent.count(),
            ahead=[
                target_pb2.AheadRound(
                    tree=tree_to_pb(d), accepted_nodes=v.accepted_nodes, next_token=v.next_token
                )
                for d, v in rounds
            ],
            suffix=None if account is None else suffix_trust_to_pb(account),
        )

    def _run_ahead(
        self, session: TargetSession, first: Round, plan: AheadPlan, max_tokens: int, deadline: float
    ) -> tuple[list[Round], SuffixTrust | None]:
        """On the model thread: the rounds this target runs on its own after `first` (core/ahead.py),
        drafted from the session's own tokens, each admitted to the KV budget like a Verify's tree; and
        the suffix account they leave where the plan carried the router's."""
        verifier = session.verifier
        drafter = session.ahead_drafter
        if drafter is None:
            limits = self.models.settings
            points = self.models.verify_points  # this replica's own curve (what it publishes)
            drafter = session.ahead_drafter = suffix_drafter(
                None, limits.max_tree_nodes, GREEDY, lambda: CostModel(points, draft_step_s=0.0)
            )

        def admit(draft: DraftTree) -> bool:
            end = session.committed_length + draft.tree.num_nodes
            if end > session.capacity:
                return False
            with self.store.lock:
                try:
                    self.store.admit(session, end)
                except ResourceExhausted:
                    return False  # the budget is full: the router's next call goes on
            return True

        def verify(draft: DraftTree) -> VerifyOutcome:
            outcome = verifier.verify(draft, 0)  # greedy: no seed is read
            if session.closed:
                raise NotFound(f"session {session.session_id!r} was released while it was being verified")
            return outcome

        rounds = run_ahead(
            first,
            lambda: verifier.token_ids,
            drafter,
            verify,
            plan,
            max_tokens,
            self.models.eos_token_ids,
            lambda: drafter.expected_suffix_tokens,
            admit,
            self.recent.count,
            deadline,
        )
        return rounds, None if plan.suffix is None else drafter.suffix_trust().observed()

    def _run(self, context: grpc.ServicerContext | None, fn: Callable[..., R], *args: object) -> R:
        """Runs fn as a batching job on the model thread; a cancelled or expired RPC stops its job at
        the next forward, which frees its place in the batch."""
        future = self.model.submit(fn, *args)
        if context is not None:
            context.add_callback(lambda: self.model.cancel(future))
        return future.result()

    def _done(self, session: TargetSession) -> None:
        with self.store.lock:
            session.in_flight -= 1
            if not session.closed:
                session.committed_at = time.time()
            session.changed.notify_all()  # wakes this session's KV feed only
            self._update_gauges()

    def _verify(
        self,
        session: TargetSession,
        draft: DraftTree,
        message: common_pb2.DraftTree,
        round_seed: int,
        num_top: int | None,
        ahead: AheadPlan,
        ahead_max_tokens: int,
        ahead_deadline: float,
    ) -> tuple[VerifyOutcome, list[TokenLogprob], list[Round], SuffixTrust | None]:
        """On the model thread: the message's sparse probabilities become dense rows there too; the
        committed tokens' log-probabilities come from the same forward's logits when asked. Then the
        `ahead` rounds the target runs on its own (in the same job: no hand-off between them), with the
        suffix account they leave."""
        models = self.models
        dense = with_dense_probs(
            draft, message, models.target_model.config.vocab_size, models.target_runner.device
        )
        verifier = session.verifier
        verifier.keep_logits = num_top is not None
        outcome = verifier.verify(dense, round_seed)
        if session.closed:  # released or evicted while its forward ran: nothing of it may be reported
            raise NotFound(f"session {session.session_id!r} was released while it was being verified")
        logprobs: list[TokenLogprob] = []
        if num_top is not None and verifier.last_logits is not None:
            logprobs = path_logprobs(
                verifier.last_logits,
                outcome.accepted_nodes,
                draft.tree.token_ids,
                outcome.next_token,
                num_top,
            )
        verifier.last_logits = None
        if not ahead.total:
            return outcome, logprobs, [], None
        rounds, account = self._run_ahead(session, (draft, outcome), ahead, ahead_max_tokens, ahead_deadline)
        return outcome, logprobs, rounds[1:], account

    def StreamKV(
        self, request: target_pb2.StreamKVRequest, context: grpc.ServicerContext
    ) -> Iterator[target_pb2.KVChunk]:
        check_session_id(request.session_id)
        self.metrics.kv_feed_subscribers.inc()
        try:
            for chunk in kv_feed(
                self.store,
                request.session_id,
                request.from_position,
                list(request.layers),
                self.settings.feed_chunk_positions,
                context.is_active,
                hidden_states=request.hidden_states,
            ):
                size = chunk_payload_bytes(chunk)
                self.metrics.kv_feed_bytes.inc(size)
                with telemetry.span(
                    telemetry.SPAN_KV_PUBLISH,
                    **{telemetry.ATTR_POSITIONS: chunk.num_positions, telemetry.ATTR_BYTES: size},
                ):
                    yield chunk
        finally:
            self.metrics.kv_feed_subscribers.dec()

    def Release(
        self, request: target_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> target_pb2.ReleaseResponse:
        check_session_id(request.session_id)
        released = self.store.release(request.session_id)
        self.recent.forget(request.session_id)
        self._update_gauges()
        return target_pb2.ReleaseResponse(released=released)

    def _update_gauges(self) -> None:
        self.metrics.sessions.set(len(self.store))
        self.metrics.kv_positions_reserved.set(self.store.reserved_positions)
        self.metrics.kv_positions_allocated.set(self.store.allocated_positions)
        if self.store.prefix_cache is not None:
            self.metrics.prefix_cache_bytes.set(self.store.prefix_cache.used_bytes)

    def close(self) -> None:
        self.model.close()
        self.store.clear()


def _ahead_plan(request: target_pb2.VerifyRequest, num_nodes: int, max_nodes: int) -> AheadPlan:
    """The request's plan for rounds ahead, checked; `num_nodes`: its tree's, `max_nodes`: a tree's bound."""
    suffix = None
    if request.HasField("ahead_suffix"):
        suffix = suffix_trust_from_pb(request.ahead_suffix, num_nodes, max_nodes)
    plan = AheadPlan(
        request.ahead_rounds,
        request.ahead_copy_rounds,
        request.ahead_copy_tokens,
        request.ahead_skip_run,
        request.ahead_skip_left,
        suffix,
    )
    if plan.rounds < 0 or plan.copy_rounds < 0 or not 0 <= plan.total <= MAX_AHEAD_ROUNDS:
        raise InvalidArgument(
            f"ahead_rounds and ahead_copy_rounds must be >= 0 and add up to at most {MAX_AHEAD_ROUNDS}"
        )
    if not (0 <= plan.skip_run <= MAX_SKIPPED_ROUNDS and 0 <= plan.skip_left <= MAX_SKIPPED_ROUNDS):
        raise InvalidArgument(
            f"ahead_skip_run and ahead_skip_left must be in [0, {MAX_SKIPPED_ROUNDS}], got "
            f"{plan.skip_run} and {plan.skip_left}"
        )
    if not math.isfinite(plan.copy_tokens) or plan.copy_tokens < 0:
        raise InvalidArgument(f"ahead_copy_tokens must be finite and >= 0, got {plan.copy_tokens}")
    if not math.isfinite(request.ahead_max_seconds) or request.ahead_max_seconds < 0:
        raise InvalidArgument(f"ahead_max_seconds must be finite and >= 0, got {request.ahead_max_seconds}")
    if plan.total and request.ahead_max_tokens < 1:
        raise InvalidArgument(
            f"ahead_max_tokens must be >= 1 with ahead rounds, got {request.ahead_max_tokens}"
        )
    return plan


def _top_logprobs(wanted: bool, top: int) -> int | None:
    """None when no log-probabilities are asked for; else how many top tokens to return with each."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top if wanted else None
