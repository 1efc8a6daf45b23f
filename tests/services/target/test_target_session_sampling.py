"""A target session keeps the sampling parameters of its Prefill: Verify carries none (the field is gone
from the wire), and a rebuild brings them back, so a resumed session samples as before.

Over real gRPC on the shared stack's target, called as the router calls it.
"""

from __future__ import annotations

import pytest

from specserve.core.rng import verify_round_seed
from specserve.v1 import common_pb2, draft_pb2, target_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
CAPACITY = 256
SEED = 99
SAMPLED = common_pb2.SamplingParams(temperature=1.0)
ROUNDS = 8


def test_rounds_carry_no_sampling_on_the_wire() -> None:
    assert "sampling" not in target_pb2.VerifyRequest.DESCRIPTOR.fields_by_name
    assert "sampling" not in draft_pb2.ProposeRequest.DESCRIPTOR.fields_by_name
    assert "sampling" in target_pb2.PrefillRequest.DESCRIPTOR.fields_by_name
    assert "sampling" in draft_pb2.DraftPrefillRequest.DESCRIPTOR.fields_by_name


def decode(
    stub, session_id: str, sampling: common_pb2.SamplingParams, rebuild_at: int | None = None
) -> list[int]:
    """Plain decoding through Prefill and root-only Verify calls (no draft), seeded as the router seeds
    it; with rebuild_at, the session is rebuilt from its history (as after an eviction) at that round."""
    prefill = target_pb2.PrefillRequest(
        session_id=session_id,
        token_ids=PROMPT_IDS,
        capacity=CAPACITY,
        sampling=sampling,
        step_seed=verify_round_seed(SEED, len(PROMPT_IDS)),
    )
    tokens = [*PROMPT_IDS, stub.Prefill(prefill, timeout=60).next_token]
    try:
        for round_index in range(ROUNDS):
            if round_index == rebuild_at:
                rebuild = target_pb2.PrefillRequest(
                    session_id=session_id,
                    token_ids=tokens[:-1],
                    root_token=tokens[-1],
                    capacity=CAPACITY,
                    sampling=sampling,
                )
                stub.Prefill(rebuild, timeout=60)
            tree = common_pb2.DraftTree(
                token_ids=[tokens[-1]], parent_ids=[-1], kind=common_pb2.CANDIDATE_KIND_FIXED
            )
            verify = target_pb2.VerifyRequest(
                session_id=session_id,
                tree=tree,
                committed_length=len(tokens),
                step_seed=verify_round_seed(SEED, len(tokens)),
            )
            tokens.append(stub.Verify(verify, timeout=60).next_token)
    finally:
        stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=60)
    return tokens[len(PROMPT_IDS) :]


def test_verify_samples_with_the_sessions_own_parameters(stub) -> None:
    greedy = decode(stub, "sampling-greedy", common_pb2.SamplingParams())
    sampled = decode(stub, "sampling-sampled", SAMPLED)
    assert sampled != greedy  # T = 1 on 9 tokens: the session's sampling is what Verify used
    assert decode(stub, "sampling-again", SAMPLED) == sampled  # seeded: the same tokens again
    assert decode(stub, "sampling-rebuilt", SAMPLED, rebuild_at=4) == sampled  # a rebuild keeps them
