"""The router's remote roles without models: a drafted tree travels to the target as the draft sent it,
and a verifier that retries on another target replica takes the session's load with it.

The target here is a real gRPC server with a small fake servicer; the other replica is an address where
nothing listens (UNAVAILABLE, as a target that went away).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.router.placement import HeldReplica, ReplicaSet
from services.router.remote import RemoteVerifier, RoundCounters, WireDraftTree, wire_tree
from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.serving.stack import free_port
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc


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
