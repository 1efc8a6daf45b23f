"""Rounds the target runs on its own after a Verify's tree (VerifyRequest.ahead_rounds), over real gRPC
on the shared stack's target: they commit what one round at a time commits, stop at the token budget,
and are refused where they would not be lossless or reproducible."""

from __future__ import annotations

import math

import grpc
import pytest

from specserve.core.protocols import DraftTree, RoundOutcome, SuffixTrust, VerifyOutcome
from specserve.core.suffix_drafter import SuffixDrafter
from specserve.core.tree import TokenTree
from specserve.v1 import common_pb2, target_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FIXED = common_pb2.CANDIDATE_KIND_FIXED
# Text that repeats itself, so the target's own suffix candidates have something to copy.
PROMPT_IDS = [1, 9690, 198, 504, 2365, 6354, 16848, 690, 260, 23790, 2767, 30] * 3


class Session:
    def __init__(self, stub, info, name: str, **prefill) -> None:
        self.stub, self.id = stub, name
        capacity = len(PROMPT_IDS) + 1 + info.max_tree_nodes + 128
        request = target_pb2.PrefillRequest(
            session_id=name, token_ids=PROMPT_IDS, capacity=capacity, **prefill
        )
        response = stub.Prefill(request, timeout=60)
        self.tokens = [*PROMPT_IDS, response.next_token]

    def verify(self, **fields) -> target_pb2.VerifyResponse:
        tree = common_pb2.DraftTree(token_ids=[self.tokens[-1]], parent_ids=[-1], kind=FIXED)
        request = target_pb2.VerifyRequest(
            session_id=self.id, tree=tree, committed_length=len(self.tokens), **fields
        )
        response = self.stub.Verify(request, timeout=60)
        rounds = [(tree, response)] + [(r.tree, r) for r in response.ahead]
        for tree_, round_ in rounds:
            self.tokens += [tree_.token_ids[i] for i in round_.accepted_nodes[1:]] + [round_.next_token]
        assert response.committed_length == len(self.tokens)
        return response

    def release(self) -> None:
        self.stub.Release(target_pb2.ReleaseRequest(session_id=self.id), timeout=60)


def test_rounds_ahead_commit_what_one_round_at_a_time_commits(stub, info):
    plain, ahead = Session(stub, info, "ahead-plain"), Session(stub, info, "ahead-rounds")
    try:
        for _ in range(3):
            response = ahead.verify(ahead_rounds=4, ahead_max_tokens=1000)
            assert len(response.ahead) == 4
        copying = ahead.verify(ahead_copy_rounds=8, ahead_copy_tokens=1.0, ahead_max_tokens=1000)
        while len(plain.tokens) < len(ahead.tokens):
            assert not plain.verify().ahead  # no rounds of its own unless asked
        assert plain.tokens[: len(ahead.tokens)] == ahead.tokens
        # Rounds from the session's own text: the repeated prompt is copied, several tokens a round.
        drafted = sum(len(r.tree.token_ids) - 1 for r in copying.ahead)
        assert len(ahead.tokens) - len(PROMPT_IDS) > 16 and (not copying.ahead or drafted > 0)
    finally:
        plain.release()
        ahead.release()


def test_no_round_ahead_starts_once_the_call_ran_its_time(stub, info):
    session = Session(stub, info, "ahead-time")
    try:
        assert not session.verify(ahead_rounds=8, ahead_max_tokens=100, ahead_max_seconds=1e-6).ahead
        assert len(session.verify(ahead_rounds=8, ahead_max_tokens=100, ahead_max_seconds=60).ahead) == 8
    finally:
        session.release()


def test_rounds_the_router_would_skip_its_drafter_for_verify_the_root_alone(stub, info):
    session = Session(stub, info, "ahead-skipped")
    try:
        response = session.verify(ahead_rounds=6, ahead_max_tokens=1000, ahead_skip_run=4, ahead_skip_left=3)
        trees = [len(r.tree.token_ids) for r in response.ahead]
        assert len(trees) == 6 and trees[:3] == [1, 1, 1]  # then the drafter copies the repeated prompt
        assert any(size > 1 for size in trees[3:])
    finally:
        session.release()


def account(**fields) -> target_pb2.SuffixTrust:
    """A router's suffix account: a mid trust and the root-alone means unless `fields` say otherwise."""
    return target_pb2.SuffixTrust(**({"trust": 0.7, "mean_nodes": 1.0, "mean_emitted": 1.0} | fields))


def test_the_target_continues_from_the_routers_suffix_account(stub, info):
    """The target's drafter takes the account the request carries, observes the request's own tree as
    the router's drafter proposed it (its suffix nodes, its prediction), and returns the account after
    the rounds: nothing pending, and the same rounds from a lower trust leave a lower one."""
    session = Session(stub, info, "ahead-account")
    try:
        root = session.tokens[-1]
        tree = common_pb2.DraftTree(token_ids=[root, 30], parent_ids=[-1, 0], kind=FIXED)
        sent = account(trust=0.5, predicted=1.0, suffix_nodes=[1])
        request = target_pb2.VerifyRequest(
            session_id=session.id,
            tree=tree,
            committed_length=len(session.tokens),
            ahead_rounds=1,
            ahead_max_tokens=1,  # the request's own round uses the budget: no round runs after it
            ahead_suffix=sent,
        )
        response = stub.Verify(request, timeout=60)
        assert not response.ahead
        expected = SuffixDrafter(None, info.max_tree_nodes)  # what the router's drafter would learn
        expected.adopt_trust(SuffixTrust(0.5, 1.0, 1.0, 1.0, frozenset({1})))
        draft = DraftTree(TokenTree.chain([root, 30]), suffix_nodes=frozenset({1}))
        expected.observe(RoundOutcome.of(draft, VerifyOutcome(list(response.accepted_nodes), 0)))
        returned = response.suffix
        assert (returned.trust, returned.mean_nodes, returned.mean_emitted) == pytest.approx(
            (expected.trust, expected.mean_nodes, expected.mean_emitted)
        )
        assert not returned.HasField("predicted") and not returned.suffix_nodes
    finally:
        session.release()
    doubtful, trusting = Session(stub, info, "ahead-doubtful"), Session(stub, info, "ahead-trusting")
    try:
        plan = {"ahead_rounds": 6, "ahead_max_tokens": 1000}
        low = doubtful.verify(**plan, ahead_suffix=account(trust=0.1))
        high = trusting.verify(**plan, ahead_suffix=account(trust=1.4))
        assert [r.tree.token_ids for r in low.ahead] == [r.tree.token_ids for r in high.ahead]
        assert any(len(r.tree.token_ids) > 1 for r in low.ahead)  # the repeated prompt is copied
        assert low.suffix.trust < high.suffix.trust
        assert not doubtful.verify(**plan).HasField("suffix")  # none asked for, none returned
    finally:
        doubtful.release()
        trusting.release()


def test_rounds_ahead_stop_at_the_token_budget(stub, info):
    session = Session(stub, info, "ahead-budget")
    try:
        before = len(session.tokens)
        response = session.verify(ahead_rounds=8, ahead_max_tokens=2)
        assert len(response.ahead) <= 1  # the first round commits at least one token, the next another
        assert 2 <= len(session.tokens) - before <= 1 + info.max_tree_nodes + 1
    finally:
        session.release()


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"ahead_rounds": 9, "ahead_max_tokens": 10}, id="more-than-eight"),
        pytest.param({"ahead_rounds": 5, "ahead_copy_rounds": 4, "ahead_max_tokens": 10}, id="nine-in-all"),
        pytest.param({"ahead_rounds": -1, "ahead_max_tokens": 10}, id="negative"),
        pytest.param({"ahead_rounds": 2}, id="no-token-budget"),
        pytest.param(
            {"ahead_copy_rounds": 2, "ahead_copy_tokens": math.nan, "ahead_max_tokens": 10},
            id="nan-copy-tokens",
        ),
        pytest.param({"ahead_rounds": 2, "ahead_max_tokens": 10, "logprobs": True}, id="with-logprobs"),
        pytest.param(
            {"ahead_rounds": 2, "ahead_max_tokens": 10, "ahead_max_seconds": -1.0}, id="negative-seconds"
        ),
        pytest.param(
            {"ahead_rounds": 2, "ahead_max_tokens": 10, "ahead_max_seconds": math.inf}, id="infinite-seconds"
        ),
        pytest.param({"ahead_rounds": 2, "ahead_max_tokens": 10, "ahead_skip_run": 9}, id="skip-run-nine"),
        pytest.param(
            {"ahead_rounds": 2, "ahead_max_tokens": 10, "ahead_skip_left": -1}, id="skip-left-negative"
        ),
        pytest.param({"ahead_suffix": account(trust=2.0)}, id="trust-above-range"),
        pytest.param({"ahead_suffix": account(trust=math.nan)}, id="nan-trust"),
        pytest.param({"ahead_suffix": account(mean_nodes=0.5)}, id="mean-nodes-below-one"),
        pytest.param({"ahead_suffix": account(mean_emitted=1e9)}, id="mean-emitted-huge"),
        pytest.param({"ahead_suffix": account(predicted=-1.0)}, id="negative-prediction"),
        pytest.param({"ahead_suffix": account(suffix_nodes=[1])}, id="suffix-node-outside-the-tree"),
    ],
)
def test_bad_ahead_requests_are_invalid_argument(stub, info, expect_status, fields):
    session = Session(stub, info, "ahead-invalid")
    if "ahead_suffix" in fields:
        fields = {"ahead_rounds": 2, "ahead_max_tokens": 10, **fields}
    try:
        tree = common_pb2.DraftTree(token_ids=[session.tokens[-1]], parent_ids=[-1], kind=FIXED)
        request = target_pb2.VerifyRequest(
            session_id=session.id, tree=tree, committed_length=len(session.tokens), **fields
        )
        expect_status(INVALID, stub.Verify, request)
        assert not session.verify().ahead  # nothing was committed: the session goes on where it was
    finally:
        session.release()


def test_a_sampled_session_runs_no_round_ahead(stub, info, expect_status):
    """A sampled session's tree decides its draws: where its rounds are drafted must not change them."""
    session = Session(stub, info, "ahead-sampled", sampling=common_pb2.SamplingParams(temperature=0.7))
    try:
        tree = common_pb2.DraftTree(token_ids=[session.tokens[-1]], parent_ids=[-1], kind=FIXED)
        request = target_pb2.VerifyRequest(
            session_id=session.id,
            tree=tree,
            committed_length=len(session.tokens),
            ahead_rounds=2,
            ahead_max_tokens=10,
        )
        assert "greedy" in expect_status(INVALID, stub.Verify, request)
    finally:
        session.release()
