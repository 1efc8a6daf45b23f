"""A draft session follows the target's KV feed only while its rounds draft.

Over real gRPC on the shared stack, with the target and the draft called directly as the router calls
them. The cost policy sizes a round to the root alone under a heavy reported load: such a round must
neither wait for the mirror nor receive K/V, and the first round that drafts afterwards must see every
position committed meanwhile (its tree is the tree a session prefilled fresh at that point drafts).
"""

from __future__ import annotations

import json
import time

import pytest
from router_like_session import RouterLikeSession

from specserve.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
SEED = 99
# The GliDe draft's feed carries K/V; the hidden-state draft's carries only final hidden states.
METHODS = ("glide-cape-cost", "eagle-cape-cost")
HEAVY = 64  # sessions sharing the target: far past the load at which the cost policy stops drafting
# What the router measured asking the draft costs: a local call's. Charged instead of the calibrated
# in-process overhead, it keeps drafting alone worth it on the suite's cost record (tests/pinned_costs.py)
# for any realistic acceptance estimate (the service starts sessions from what earlier sessions of the
# suite accepted: services/draft/priors.py).
ROUND_TRIP_SECONDS = 0.001
RECENT_SECONDS = 1.1  # past the draft's load horizon (serving/recent.py): earlier tests' sessions left it


def open_greedy(
    target, draft, target_address: str, session_id: str, token_ids: list[int], method: str
) -> RouterLikeSession:
    return RouterLikeSession(target, draft, target_address, session_id, token_ids, method=method, seed=SEED)


def first_spine_token(tree: common_pb2.DraftTree) -> int:
    """The draft's greedy pick after the root (the first candidate at depth 1 carries the spine)."""
    return tree.token_ids[1]


def rounds_under_heavy_load(session: RouterLikeSession, rounds: int) -> None:
    """Rounds of the root alone: no wait for the mirror, and not a byte of K/V arrives."""
    fed = None
    for _ in range(rounds):
        response = session.propose(load=HEAVY, overhead_seconds=ROUND_TRIP_SECONDS)
        assert list(response.tree.token_ids) == [session.token_ids[-1]]
        assert response.kv_wait_seconds == 0
        fed = response.kv_feed_bytes if fed is None else fed
        assert response.kv_feed_bytes == fed
        session.verify(response.tree)


def drafting_round_sees_every_position(session: RouterLikeSession, fresh_id: str) -> None:
    """Alone again, the round drafts from every position committed meanwhile: its pick after the root is
    the pick of a session prefilled fresh with the same tokens."""
    time.sleep(RECENT_SECONDS)  # the heavy load the session reported is forgotten
    response = session.propose(load=0, overhead_seconds=ROUND_TRIP_SECONDS)
    assert len(response.tree.token_ids) > 1
    fresh = open_greedy(
        session.target,
        session.draft,
        session.target_address,
        fresh_id,
        session.token_ids[:-1],
        session.method,
    )
    try:
        assert fresh.token_ids == session.token_ids
        assert first_spine_token(response.tree) == first_spine_token(
            fresh.propose(load=0, overhead_seconds=ROUND_TRIP_SECONDS).tree
        )
    finally:
        fresh.release()
    session.verify(response.tree)


@pytest.fixture(params=METHODS)
def open_session(request, channels, shared_stack):
    target = target_pb2_grpc.TargetServiceStub(channels["target"])
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    sessions: list[RouterLikeSession] = []

    def open_(session_id: str) -> RouterLikeSession:
        session_id = f"{session_id}-{request.param}"
        sessions.append(
            open_greedy(target, draft, shared_stack.address("target"), session_id, PROMPT_IDS, request.param)
        )
        return sessions[-1]

    yield open_
    for session in sessions:
        session.release()


def test_a_session_that_never_drafted_subscribes_at_its_first_drafting_round(open_session):
    session = open_session("feed-from-the-start")
    rounds_under_heavy_load(session, 3)
    drafting_round_sees_every_position(session, "feed-from-the-start-fresh")


def test_a_round_of_the_root_alone_says_at_what_load_the_session_drafts_again(open_session):
    session = open_session("drafts-up-to")
    rounds_under_heavy_load(session, 1)
    response = session.propose(load=HEAVY, overhead_seconds=ROUND_TRIP_SECONDS)
    assert response.HasField("drafts_up_to_batch_sessions")
    up_to = response.drafts_up_to_batch_sessions
    assert 1 <= up_to < HEAVY  # it drafts alone (the module's round trip)
    session.verify(response.tree)
    time.sleep(RECENT_SECONDS)  # only the load this session reports counts from here
    response = session.propose(load=up_to + 1, overhead_seconds=ROUND_TRIP_SECONDS)
    assert len(response.tree.token_ids) == 1 and response.drafts_up_to_batch_sessions == up_to
    session.verify(response.tree)
    response = session.propose(load=up_to, overhead_seconds=ROUND_TRIP_SECONDS)
    assert len(response.tree.token_ids) > 1 and not response.HasField("drafts_up_to_batch_sessions")


def test_a_session_drops_the_feed_under_load_and_catches_up_after(open_session):
    session = open_session("feed-paused")
    time.sleep(RECENT_SECONDS)  # sessions of earlier tests left the draft's load count
    response = session.propose(
        load=0, overhead_seconds=ROUND_TRIP_SECONDS
    )  # alone: the first round drafts and follows the feed
    assert len(response.tree.token_ids) > 1 and response.kv_feed_bytes > 0
    # The same round asked again (as a router retries it) under heavy load: the root alone, and the
    # stream is dropped. Nothing is learned from a retry, so the policy's acceptance estimate is as fresh
    # as at the start, and the round after the load drops drafts again.
    session.known = len(session.token_ids) - 1
    rounds_under_heavy_load(session, 4)
    drafting_round_sees_every_position(session, "feed-paused-fresh")


def test_a_hidden_state_drafts_feed_carries_its_hidden_states_and_no_kv(
    channels, shared_stack, default_model_dir
):
    """What the eagle methods' sessions receive: each committed position's final hidden state (float32,
    the model's width), nothing of the K/V a GliDe draft reads."""
    target = target_pb2_grpc.TargetServiceStub(channels["target"])
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    hidden_size = json.loads((default_model_dir / "config.json").read_text())["hidden_size"]
    session = open_greedy(
        target, draft, shared_stack.address("target"), "hidden-only", PROMPT_IDS, "eagle-cape"
    )  # fixed depth: drafts every round, whatever the acceptance
    try:
        for _ in range(2):
            response = session.propose()
            assert len(response.tree.token_ids) > 1
            session.verify(response.tree)
        # the round's view: every position the draft had been sent but the root (its state comes next)
        assert response.kv_feed_bytes == (session.known - 1) * hidden_size * 4
    finally:
        session.release()


@pytest.mark.parametrize("method", ["vanilla", "vanilla-cape-cost", "mcsd"])
def test_a_draft_that_reads_nothing_of_the_target_opens_no_feed(channels, shared_stack, method):
    """The vanilla methods' drafts read no target state (their drafters declare so): their sessions draft
    every round without a KV-feed subscription, so not a byte of K/V reaches the draft and no round waits."""
    target = target_pb2_grpc.TargetServiceStub(channels["target"])
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    session = open_greedy(
        target, draft, shared_stack.address("target"), f"no-feed-{method}", PROMPT_IDS, method
    )
    try:
        time.sleep(RECENT_SECONDS)  # alone: every round drafts
        for _ in range(3):
            response = session.propose(load=0, overhead_seconds=ROUND_TRIP_SECONDS)
            assert len(response.tree.token_ids) > 1
            assert response.kv_feed_bytes == 0 and response.kv_wait_seconds == 0
            session.verify(response.tree)
    finally:
        session.release()
