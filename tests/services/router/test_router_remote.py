"""The router's remote roles without models: a drafted tree travels to the target as the draft sent it,
a verifier that retries on another target replica takes the session's load with it, and a drafter does
not ask a draft that said the load makes its rounds the root alone.

The services here are real gRPC servers with small fake servicers; the other replica is an address where
nothing listens (UNAVAILABLE, as a target that went away).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from services.router.placement import HeldReplica, ReplicaSet
from services.router.remote import (
    MAX_SKIPPED_CALLS,
    RemoteDrafter,
    RemoteVerifier,
    RoundCounters,
    RoundTripMean,
    WireDraftTree,
    wire_tree,
)
from specserve.core.protocols import AheadPlan, CandidateKind, DraftTree, RoundOutcome, SuffixTrust
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.serving.stack import free_port
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def test_a_drafted_tree_travels_as_the_draft_sent_it() -> None:
    q = common_pb2.SparseProbs(node=0, token_ids=[3, 9], probs=[0.75, 0.25])
    message = common_pb2.DraftTree(
        token_ids=[1, 3], parent_ids=[-1, 0], kind=common_pb2.CANDIDATE_KIND_SAMPLED, draft_probs=[q]
    )
    drafted = WireDraftTree(TokenTree((1, 3), (-1, 0)), CandidateKind.SAMPLED, message=message)
    assert wire_tree(drafted) is message and not drafted.draft_probs  # no tensors in the router
    alone = wire_tree(DraftTree.root_only(1))  # the draft failed or was not asked: the root alone
    assert list(alone.token_ids) == [1] and not alone.draft_probs


class OneTokenTarget(target_pb2_grpc.TargetServiceServicer):
    """Prefills anything and always chooses token 7; remembers the sampling it was given."""

    def __init__(self) -> None:
        self.prefills: list[target_pb2.PrefillRequest] = []

    def Prefill(self, request, context):
        self.prefills.append(request)
        return target_pb2.PrefillResponse(next_token=7, committed_length=len(request.token_ids))

    def Release(self, request, context):
        return target_pb2.ReleaseResponse(released=True)


@pytest.fixture
def live_target():
    """(address, servicer) of a real gRPC server running OneTokenTarget."""
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = OneTokenTarget()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("localhost:0")
    server.start()
    yield f"localhost:{port}", servicer
    server.stop(None)


def test_load_follows_a_verifier_that_retries_on_another_replica(live_target) -> None:
    live, servicer = live_target
    dead = f"localhost:{free_port()}"  # nothing listens there
    replicas = ReplicaSet([dead, live])
    held = HeldReplica(replicas, "session-1", preferred=dead)
    channels: dict[str, grpc.Channel] = {}

    def stub_for(address: str) -> target_pb2_grpc.TargetServiceStub:
        channels.setdefault(address, grpc.insecure_channel(address))
        return target_pb2_grpc.TargetServiceStub(channels[address])

    sampling = SamplingParams(temperature=0.5, top_k=3)
    verifier = RemoteVerifier("session-1", stub_for, held, sampling, 64, 10.0, RoundCounters())
    try:
        assert (replicas.load(dead), replicas.load(live)) == (1, 0)
        assert verifier.prefill([1, 2, 3], round_seed=11) == 7
        assert verifier.address == live
        assert (replicas.load(dead), replicas.load(live)) == (0, 1)  # the load moved with the session
        [prefill] = servicer.prefills
        assert (prefill.sampling.temperature, prefill.sampling.top_k, prefill.step_seed) == (0.5, 3, 11)
        verifier.release()
        held.release()
        assert (replicas.load(dead), replicas.load(live)) == (0, 0)
    finally:
        for channel in channels.values():
            channel.close()


class LoadedDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers every round with the root alone and says it would draft up to `up_to` sessions (None:
    says nothing, as a draft whose round was the root alone for another reason than the load)."""

    def __init__(self, up_to: int | None) -> None:
        self.up_to = up_to
        self.proposes = 0
        self.token_ids: list[int] = []
        self.requests: list[draft_pb2.ProposeRequest] = []

    def Prefill(self, request, context):
        self.token_ids = list(request.token_ids)
        return draft_pb2.DraftPrefillResponse()

    def Propose(self, request, context):
        self.proposes += 1
        self.requests.append(request)
        self.token_ids = [*self.token_ids[: request.from_position], *request.new_token_ids]
        tree = common_pb2.DraftTree(token_ids=[self.token_ids[-1]], parent_ids=[-1])
        response = draft_pb2.ProposeResponse(tree=tree)
        if self.up_to is not None:
            response.drafts_up_to_batch_sessions = self.up_to
        return response


@contextmanager
def serving(draft: draft_pb2_grpc.DraftServiceServicer) -> Iterator[grpc.Channel]:
    """A channel to a real gRPC server running `draft`."""
    server = grpc.server(ThreadPoolExecutor(2))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, server)
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            yield channel
    finally:
        server.stop(None)


def remote_drafter(
    channel: grpc.Channel,
    method: str = "glide-cape-cost",
    counters: RoundCounters | None = None,
    session_id: str = "s",
    round_trips: RoundTripMean | None = None,
) -> RemoteDrafter:
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    return RemoteDrafter(
        session_id, method, stub, lambda: "localhost:1", SamplingParams(), 256, 10.0,
        counters or RoundCounters(), round_trips=round_trips,
    )  # fmt: skip


def test_the_router_skips_draft_calls_while_the_load_is_above_what_the_draft_drafts_at() -> None:
    draft = LoadedDraft(up_to=4)
    load = {"sessions": 10}
    counters = RoundCounters()
    with serving(draft) as channel:
        drafter = remote_drafter(channel, counters=counters)
        token_ids = [1, 2, 3]
        for round_index in range(1 + MAX_SKIPPED_CALLS + 1):
            assert drafter.propose(token_ids, 0, load["sessions"]).tree.token_ids == (token_ids[-1],)
            token_ids.append(10 + round_index)
        # the first call, then MAX_SKIPPED_CALLS rounds answered without one, then a call again
        assert draft.proposes == 2 and counters.draft_calls_skipped == MAX_SKIPPED_CALLS
        load["sessions"] = 4  # the load fell to where the draft drafts: every round asks
        for _ in range(3):
            drafter.propose(token_ids, 0, load["sessions"])
            token_ids.append(5)
        assert draft.proposes == 5
        draft.up_to = None  # a draft that says nothing stops nothing
        for sessions in (4, 100):
            load["sessions"] = sessions
            drafter.propose(token_ids, 0, load["sessions"])
            token_ids.append(5)
        assert draft.proposes == 7


def test_the_next_call_says_what_the_round_of_the_drafts_last_tree_committed() -> None:
    """Rounds the draft is not asked for (suffix candidates alone, or skipped under load) may follow the
    round of its tree: the next Propose carries the count of that round's tokens, not of theirs."""
    draft = LoadedDraft(up_to=None)
    with serving(draft) as channel:
        drafter = remote_drafter(channel, "glide-cape-suffix")
        token_ids = [1, 2, 3]
        own = drafter.propose(token_ids, 0, 1)
        drafter.observe(RoundOutcome(own, (0,), 4))  # its round: the target's token alone
        token_ids.append(4)
        # A round of suffix candidates the loop did not ask this drafter for: 3 tokens committed.
        suffix = DraftTree(
            TokenTree((4, 5, 6), (-1, 0, 1)), CandidateKind.FIXED, suffix_nodes=frozenset({1, 2})
        )
        drafter.observe(RoundOutcome(suffix, (0, 1, 2), 7))
        token_ids += [5, 6, 7]
        drafter.propose(token_ids, 0, 1)
    first, second = draft.requests
    assert not first.HasField("last_round_committed")  # no round of the draft's before
    assert second.last_round_committed == 1
    assert list(second.new_token_ids) == [4, 5, 6, 7]


def test_a_new_session_starts_from_the_routers_measured_draft_round_trip() -> None:
    round_trips = RoundTripMean()
    with serving(LoadedDraft(up_to=None)) as channel:
        first = remote_drafter(channel, session_id="first", round_trips=round_trips)
        assert first.overhead_s == 0  # nothing measured yet
        first.propose([1, 2, 3], 0, 1)
        assert first.overhead_s == round_trips.seconds == 0  # the opening call is not a round's cost
        first.propose([1, 2, 3, 4], 0, 1)
        assert round_trips.seconds == first.overhead_s > 0
        second = remote_drafter(channel, session_id="second", round_trips=round_trips)
        assert second.overhead_s == round_trips.seconds


class SlowOpeningDraft(LoadedDraft):
    """Takes OPENING_SECONDS over a session's first Propose (the prompt's K/V catching up), then answers
    at once."""

    OPENING_SECONDS = 0.3

    def Propose(self, request, context):
        if self.proposes == 0:
            time.sleep(self.OPENING_SECONDS)
        return super().Propose(request, context)


def test_the_opening_proposes_one_time_work_is_not_charged_to_every_round() -> None:
    with serving(SlowOpeningDraft(up_to=None)) as channel:
        drafter = remote_drafter(channel)
        token_ids = [1, 2, 3]
        for _ in range(3):
            drafter.propose(token_ids, 0, 1)
            token_ids.append(5)
        assert 0 < drafter.overhead_s < SlowOpeningDraft.OPENING_SECONDS / 3


class AheadTarget(OneTokenTarget):
    """Verifies any tree by accepting its whole first path and choosing 7; answers rounds ahead with
    two-node chains (root, 5), each accepted, whatever the plan allowed; returns `returned_trust` as the
    suffix account after them where the request carried one."""

    def __init__(self) -> None:
        super().__init__()
        self.verifies: list[target_pb2.VerifyRequest] = []
        self.returned_trust = 0.9

    def Verify(self, request, context):
        self.verifies.append(request)
        tree = request.tree
        path = [0, *[i for i, p in enumerate(tree.parent_ids) if i and p == i - 1]]
        ahead = []
        root = 7
        for _ in range(request.ahead_rounds + request.ahead_copy_rounds):
            chain = common_pb2.DraftTree(token_ids=[root, 5], parent_ids=[-1, 0], kind=tree.kind)
            ahead.append(target_pb2.AheadRound(tree=chain, accepted_nodes=[0, 1], next_token=7))
        committed = request.committed_length + len(path) + 2 * len(ahead)
        response = target_pb2.VerifyResponse(
            accepted_nodes=path, next_token=7, committed_length=committed, ahead=ahead
        )
        if request.HasField("ahead_suffix"):
            response.suffix.CopyFrom(
                target_pb2.SuffixTrust(trust=self.returned_trust, mean_nodes=2.0, mean_emitted=2.0)
            )
        return response


def test_rounds_ahead_are_asked_for_a_greedy_session_only_and_come_back_as_suffix_rounds() -> None:
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = AheadTarget()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    address = f"localhost:{server.add_insecure_port('localhost:0')}"
    server.start()
    channel = grpc.insecure_channel(address)
    replicas = ReplicaSet([address])

    def verifier(**kwargs) -> RemoteVerifier:
        held = HeldReplica(replicas, "session-1", preferred=address)
        stub_for = lambda _: target_pb2_grpc.TargetServiceStub(channel)  # noqa: E731
        sampling = kwargs.pop("sampling", SamplingParams())
        return RemoteVerifier("s", stub_for, held, sampling, 64, 10.0, RoundCounters(), **kwargs)

    try:
        greedy = verifier(max_ahead_rounds=8, max_ahead_seconds=0.05)
        assert greedy.ahead_limit == 8 and verifier().ahead_limit == 0  # 0 unless the router allows
        assert verifier(max_ahead_rounds=8, sampling=SamplingParams(temperature=0.5)).ahead_limit == 0
        assert verifier(max_ahead_rounds=8, logprobs=2).ahead_limit == 0
        greedy.prefill([1, 2, 3], round_seed=0)
        rounds = greedy.verify_ahead(DraftTree(TokenTree.chain([7, 4])), 0, AheadPlan(2, 1, 1.5), 50)
        sent = servicer.verifies[-1]
        assert (sent.ahead_rounds, sent.ahead_copy_rounds, sent.ahead_copy_tokens) == (2, 1, 1.5)
        assert sent.ahead_max_tokens == 50 and sent.ahead_max_seconds == pytest.approx(0.05)
        assert len(rounds) == 4 and rounds[0][1].accepted_nodes == [0, 1]
        for draft, outcome in rounds[1:]:
            assert draft.tree.token_ids == (7, 5) and draft.suffix_nodes == frozenset({1})
            assert outcome.next_token == 7
        assert greedy.history == [1, 2, 3, 7, 4, 7, 5, 7, 5, 7, 5, 7]
        assert not sent.HasField("ahead_suffix") and greedy.take_suffix_trust() is None
        greedy.verify(DraftTree.root_only(7), 0)  # a plain round asks for none
        assert servicer.verifies[-1].ahead_rounds == servicer.verifies[-1].ahead_max_tokens == 0
        # The loop's suffix account goes with the plan, and the target's comes back, once
        mine = SuffixTrust(0.4, 3.0, 2.5, predicted=1.25, suffix_nodes=frozenset({1}))
        greedy.verify_ahead(DraftTree(TokenTree.chain([7, 4])), 0, AheadPlan(2, suffix=mine), 50)
        sent = servicer.verifies[-1].ahead_suffix
        assert (sent.trust, sent.mean_nodes, sent.mean_emitted, sent.predicted) == (0.4, 3.0, 2.5, 1.25)
        assert list(sent.suffix_nodes) == [1]
        assert greedy.take_suffix_trust() == SuffixTrust(0.9, 2.0, 2.0)
        assert greedy.take_suffix_trust() is None
        # One out of range is the target's fault: the router's drafter keeps its own, the session goes on
        servicer.returned_trust = 7.0
        rounds = greedy.verify_ahead(DraftTree(TokenTree.chain([7, 4])), 0, AheadPlan(2, suffix=mine), 50)
        assert len(rounds) == 3 and greedy.take_suffix_trust() is None
    finally:
        channel.close()
        server.stop(None)
