"""A session driven round by round over gRPC as the router's loop drives it (core/loop.py), with the
target and the draft called directly: what the draft service's tests need beyond the router."""

from __future__ import annotations

from specserve.catalog import CATALOG, Method
from specserve.core.rng import draft_round_seed, verify_round_seed
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

CAPACITY = 256


class RouterLikeSession:
    def __init__(
        self,
        target: target_pb2_grpc.TargetServiceStub,
        draft: draft_pb2_grpc.DraftServiceStub,
        target_address: str,
        session_id: str,
        token_ids: list[int],
        *,
        method: str,
        seed: int,  # the request seed every round's seeds derive from (core/rng.py)
        sampling: common_pb2.SamplingParams | None = None,  # None: greedy
        request_seed: int | None = None,  # sent to the draft; None = it never prepares ahead
        capacity: int = CAPACITY,
        tenant: str = "",
    ) -> None:
        self.target, self.draft, self.session_id = target, draft, session_id
        self.target_address, self.seed, self.method = target_address, seed, method
        prefill = target.Prefill(
            target_pb2.PrefillRequest(
                session_id=session_id,
                token_ids=token_ids,
                capacity=capacity,
                sampling=sampling,
                step_seed=verify_round_seed(seed, len(token_ids)),
                # as the router does for a method whose draft reads the target's hidden states
                keep_hidden_states=CATALOG[Method(method)].hidden_states,
                num_prompt_tokens=len(token_ids),
                tenant=tenant,
            ),
            timeout=60,
        )
        self.token_ids = [*token_ids, prefill.next_token]
        self.draft_prefill = draft.Prefill(
            draft_pb2.DraftPrefillRequest(
                session_id=session_id,
                method=method,
                token_ids=self.token_ids,
                target_address=target_address,
                capacity=capacity,
                sampling=sampling,
                request_seed=request_seed,
                num_prompt_tokens=len(token_ids),
                tenant=tenant,
            ),
            timeout=60,
        )
        self.known = len(self.token_ids)  # tokens the draft has been sent

    def propose(
        self, step_seed: int | None = None, load: int = 0, overhead_seconds: float = 0.0
    ) -> draft_pb2.ProposeResponse:
        """load: the target's batch_sessions as the router would pass it on."""
        response = self.draft.Propose(
            draft_pb2.ProposeRequest(
                session_id=self.session_id,
                from_position=self.known,
                new_token_ids=self.token_ids[self.known :],
                step_seed=draft_round_seed(self.seed, len(self.token_ids))
                if step_seed is None
                else step_seed,
                target_address=self.target_address,
                batch_sessions=load,
                overhead_seconds=overhead_seconds,
            ),
            timeout=60,
        )
        self.known = len(self.token_ids)
        return response

    def verify(self, tree: common_pb2.DraftTree) -> None:
        position = len(self.token_ids)
        outcome = self.target.Verify(
            target_pb2.VerifyRequest(
                session_id=self.session_id,
                tree=tree,
                committed_length=position,
                step_seed=verify_round_seed(self.seed, position),
            ),
            timeout=60,
        )
        self.token_ids += [tree.token_ids[i] for i in outcome.accepted_nodes[1:]] + [outcome.next_token]

    def release(self) -> None:
        self.draft.Release(draft_pb2.DraftReleaseRequest(session_id=self.session_id), timeout=60)
        self.target.Release(target_pb2.ReleaseRequest(session_id=self.session_id), timeout=60)
