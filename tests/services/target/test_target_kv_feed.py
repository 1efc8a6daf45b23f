"""The target's KV feed carries, with each chunk's K/V, the tokens at those positions, and on the chunk
that reaches the committed length the new root: what a draft needs to build the next round unasked.

Over real gRPC on the shared stack's target process.
"""

from __future__ import annotations

import pytest

from specserve.v1 import common_pb2, target_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
SESSION = "kv-feed-tokens"


def read_until(feed, end: int) -> list[target_pb2.KVChunk]:
    """Chunks until one ends at position `end`."""
    chunks = []
    for chunk in feed:
        chunks.append(chunk)
        if chunk.start_position + chunk.num_positions == end:
            return chunks
    raise AssertionError("the feed ended early")


def test_chunks_carry_their_tokens_and_the_new_root(stub):
    prefill = stub.Prefill(
        target_pb2.PrefillRequest(session_id=SESSION, token_ids=PROMPT_IDS, capacity=128), timeout=60
    )
    feed = stub.StreamKV(
        target_pb2.StreamKVRequest(session_id=SESSION, from_position=0, layers=[0]), timeout=60
    )
    try:
        chunks = read_until(feed, len(PROMPT_IDS))
        assert [t for c in chunks for t in c.token_ids] == PROMPT_IDS
        assert all(len(c.token_ids) == c.num_positions for c in chunks)
        assert chunks[-1].root_token == prefill.next_token
        assert not any(c.HasField("root_token") for c in chunks[:-1])

        # One round: the root and a guess after it. The root's KV and any accepted guess are committed;
        # the target's own next token is the new root.
        root = prefill.next_token
        tree = common_pb2.DraftTree(
            token_ids=[root, (root + 1) % 1000], parent_ids=[-1, 0], kind=common_pb2.CANDIDATE_KIND_FIXED
        )
        outcome = stub.Verify(
            target_pb2.VerifyRequest(session_id=SESSION, tree=tree, committed_length=len(PROMPT_IDS) + 1),
            timeout=60,
        )
        committed = [root] + [tree.token_ids[i] for i in outcome.accepted_nodes[1:]]
        (chunk,) = read_until(feed, outcome.committed_length - 1)
        assert chunk.start_position == len(PROMPT_IDS)
        assert list(chunk.token_ids) == committed
        assert chunk.root_token == outcome.next_token
    finally:
        feed.cancel()
        stub.Release(target_pb2.ReleaseRequest(session_id=SESSION), timeout=60)
