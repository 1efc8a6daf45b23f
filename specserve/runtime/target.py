"""The in-process verifier: one sequence's target KV cache, verification and commit."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.core.accept import accept_draft, choose_token
from specserve.core.protocols import DraftTree, VerifyOutcome
from specserve.core.sampling_params import SamplingParams
from specserve.errors import FailedPrecondition
from specserve.runtime.runner import ModelRunner


class LocalVerifier:
    """Target state of one sequence. The cache holds every committed token but the newest (the root)."""

    def __init__(self, runner: ModelRunner, capacity: int) -> None:
        self.runner = runner
        self.cache = runner.new_cache(capacity)
        # Every committed token, the root last: len(token_ids) == cache.length + 1 once prefilled. The
        # service's KV feed sends them with the KV so a draft can start the next round on its own.
        self.token_ids: list[int] = []

    @property
    def root_token(self) -> int | None:
        return self.token_ids[-1] if self.token_ids else None

    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams, seed: int) -> int:
        self.cache.truncate(0)
        logits = self.runner.forward(self.cache, prompt_ids, last_only=True)  # [V]
        root = choose_token(logits, params, seed)
        self.token_ids = [*prompt_ids, root]
        return root

    def resume(self, token_ids: Sequence[int]) -> None:
        """Rebuilds the state after committed `token_ids` (the last is the root) without choosing anything:
        a target that lost a session's KV continues it exactly where it was."""
        self.cache.truncate(0)
        if len(token_ids) > 1:
            self.runner.forward(self.cache, token_ids[:-1], last_only=True)
        self.token_ids = list(token_ids)

    def verify(self, draft: DraftTree, params: SamplingParams, seed: int) -> VerifyOutcome:
        tree = draft.tree
        if tree.token_ids[0] != self.root_token:
            raise FailedPrecondition(
                f"draft root {tree.token_ids[0]} is not the last committed token {self.root_token}"
            )
        start = self.cache.length
        logits = self.runner.forward(
            self.cache, tree.token_ids, None if tree.is_chain() else tree.parent_ids
        )  # [N, V]
        outcome = accept_draft(logits, draft, params, seed)
        self.cache.commit_path(start, outcome.accepted_nodes)
        self.token_ids += [tree.token_ids[i] for i in outcome.accepted_nodes[1:]]
        if outcome.next_token is None:
            # Target-rooted: no token after the path is committed, so the path's last token becomes the
            # next root, and a root's KV is computed by the round that verifies it (once more, cheaply).
            self.cache.truncate(start + len(outcome.accepted_nodes) - 1)
        else:
            self.token_ids.append(outcome.next_token)
        return outcome

    def release(self) -> None:
        self.cache.truncate(0)
        self.token_ids = []
