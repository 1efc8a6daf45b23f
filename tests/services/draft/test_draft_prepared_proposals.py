"""The draft builds each round's tree ahead, when the KV feed delivers the commit it starts from, and
returns it only to a Propose that asks for exactly that tree.

Over real gRPC on the shared stack (which turns SPECSERVE_DRAFT_PREPARE_AHEAD on), with the target and
the draft called directly as the router calls them. Sampled chains (T > 0) make the tree depend on the
seed, so "the same tree" means the seed derivation matches the router's too. The session's sampling
travels once, in each service's Prefill; Propose and Verify carry none.
"""

from __future__ import annotations

import time

import pytest
from router_like_session import RouterLikeSession

from specserve.core.rng import draft_round_seed
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
SEED = 2024
SAMPLED = common_pb2.SamplingParams(temperature=0.8)
PREPARE_SECONDS = 1.0  # far longer than one draft forward: the tree is ready when Propose comes


@pytest.fixture(scope="module")
def target(channels) -> target_pb2_grpc.TargetServiceStub:
    return target_pb2_grpc.TargetServiceStub(channels["target"])


@pytest.fixture(scope="module")
def draft(channels) -> draft_pb2_grpc.DraftServiceStub:
    return draft_pb2_grpc.DraftServiceStub(channels["draft"])


def open_session(target, draft, target_address: str, session_id: str, seed: int | None) -> RouterLikeSession:
    return RouterLikeSession(
        target, draft, target_address, session_id, PROMPT_IDS,
        method="glide", seed=SEED, sampling=SAMPLED, request_seed=seed,
    )  # fmt: skip


def run_rounds(session: RouterLikeSession, rounds: int) -> list[draft_pb2.ProposeResponse]:
    responses = []
    for _ in range(rounds):
        response = session.propose()
        responses.append(response)
        session.verify(response.tree)
        time.sleep(PREPARE_SECONDS)
    return responses


def test_prepared_trees_are_the_trees_propose_would_build(target, draft, shared_stack):
    address = shared_stack.address("target")
    ahead = open_session(target, draft, address, "prepared-ahead", seed=SEED)
    asked = open_session(target, draft, address, "prepared-never", seed=None)  # no seed: never ahead
    try:
        ahead_responses = run_rounds(ahead, 4)
        asked_responses = run_rounds(asked, 4)
    finally:
        ahead.release()
        asked.release()
    # Every round after the first is built ahead (the first may be too, if the prompt's KV arrives before
    # its Propose: the sampling came with Prefill).
    assert all(r.prepared for r in ahead_responses[1:])
    assert not any(r.prepared for r in asked_responses)
    assert ahead.token_ids == asked.token_ids  # same seeds, same trees, same sampled tokens
    for a, b in zip(ahead_responses, asked_responses, strict=True):
        assert a.tree == b.tree
    assert any(len(r.tree.token_ids) > 1 for r in ahead_responses)


def test_a_propose_that_asks_for_another_tree_gets_a_fresh_one(target, draft, shared_stack):
    session = open_session(target, draft, shared_stack.address("target"), "prepared-mismatch", seed=SEED)
    try:
        run_rounds(session, 1)  # now a tree for the next round is prepared with that round's seed
        other_seed = draft_round_seed(SEED, len(session.token_ids)) + 1
        response = session.propose(step_seed=other_seed)
        assert not response.prepared
        session.verify(response.tree)  # a well-formed tree for this session's root
        assert len(session.token_ids) > len(PROMPT_IDS) + 2
    finally:
        session.release()
