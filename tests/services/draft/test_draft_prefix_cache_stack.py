"""The draft's prefix cache through the shared stack, on the default model.

A second session on a prompt of whole cached blocks loads them into its mirror and is fed only what
follows, and its drafter loads its own K/V over them (the draft block's self-attention) instead of
encoding them; its trees and the target's acceptance of them are those of the first session, whose mirror
was fed from position 0 and whose drafter encoded the whole prompt (the output is the target's either
way). Another tenant's same prompt loads nothing. The vanilla draft reads nothing of the target: it has
no mirror, and caches its own K/V alone.
"""

from __future__ import annotations

import pytest
from router_like_session import RouterLikeSession
from stack_metrics import metric

from specserve.v1 import draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

CHUNK = 256  # the stack's target prefill chunk; its prefix cache block is that, or finer (32 tokens)
PROMPT_IDS = [1, *[(37 * i + 11) % 9000 + 100 for i in range(CHUNK + 40)]]
CAPACITY = 512
SEED = 7
ROUNDS = 5


def rounds(session: RouterLikeSession) -> list[tuple[list[int], int]]:
    """Per round: the tree's tokens, and how many tokens the target committed after its root."""
    out = []
    for _ in range(ROUNDS):
        tree = session.propose().tree
        before = len(session.token_ids)
        session.verify(tree)
        out.append((list(tree.token_ids), len(session.token_ids) - before))
    return out


def drafter_hits(stack) -> float:
    return metric(stack, "draft", "specserve:drafter_prefix_cache_hits_total")


@pytest.mark.parametrize("method", ["glide-cape", "eagle-cape", "vanilla-cape-svip"])
def test_a_second_session_starts_from_the_drafts_cache_and_drafts_the_same(channels, shared_stack, method):
    target = target_pb2_grpc.TargetServiceStub(channels["target"])
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])

    def open_(session_id: str, tenant: str) -> RouterLikeSession:
        return RouterLikeSession(
            target,
            draft,
            shared_stack.address("target"),
            f"{session_id}-{method}",
            PROMPT_IDS,
            method=method,
            seed=SEED,
            capacity=CAPACITY,
            tenant=tenant,
        )

    # Published whether or not the target's cache holds anything yet (the draft's block is the target's)
    block = target.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=60).prefix_cache_block_tokens
    assert block in (32, CHUNK)
    first = open_("dc-first", f"tenant-a-{method}")
    try:
        first_rounds = rounds(first)
    finally:
        first.release()
    second = open_("dc-second", f"tenant-a-{method}")
    other = open_("dc-other", f"tenant-b-{method}")
    try:
        mirrored = not method.startswith("vanilla")
        assert first.draft_prefill.cached_tokens == 0
        # the prompt's whole blocks but the root's (the mirror holds the positions before it)
        whole = (len(PROMPT_IDS) - 1) // block * block
        assert second.draft_prefill.cached_tokens == (whole if mirrored else 0)
        assert other.draft_prefill.cached_tokens == 0
        before = drafter_hits(shared_stack)
        assert rounds(second) == first_rounds
        # the drafter's own K/V: whole prefill chunks of the prompt before the root
        assert drafter_hits(shared_stack) - before == (len(PROMPT_IDS) - 1) // CHUNK * CHUNK
        before = drafter_hits(shared_stack)
        assert rounds(other) == first_rounds
        assert drafter_hits(shared_stack) == before
        assert sum(committed for _, committed in first_rounds) > ROUNDS  # drafts were accepted
    finally:
        second.release()
        other.release()
