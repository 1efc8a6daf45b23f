"""A round's outcome, computed once: what was drafted, which path the target accepted, and what that means
for each reader (the stats, the stop policy, the suffix index's trust, the router's metrics).

The loop builds it from the verifier's answer (`RoundOutcome.of`) and hands it to the drafter's `observe`
and to the caller's `on_round`. Where only tokens travel (a draft replica learns a round from the
committed tokens of its next Propose), `RoundOutcome.from_committed` walks the tree along them; the walk
is exact: a rejected child is never the token emitted at its depth (greedy emits the target's argmax,
which differs; the sampled and fixed rules leave it no mass in the residual), so the walk stops where
the accepted path did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.core.protocols import DraftTree, VerifyOutcome
from specserve.core.tree import tree_children


@dataclass(frozen=True)
class RoundOutcome:
    draft: DraftTree
    accepted_nodes: tuple[int, ...]  # root first: the path the target kept
    next_token: int | None  # the bonus or recovered token; None after a target-rooted round

    @classmethod
    def of(cls, draft: DraftTree, verified: VerifyOutcome) -> RoundOutcome:
        return cls(draft, tuple(verified.accepted_nodes), verified.next_token)

    @classmethod
    def from_committed(cls, draft: DraftTree, committed: Sequence[int]) -> RoundOutcome:
        """The round whose tokens committed after its root were `committed` (accepted path, then the
        bonus or recovered token when there is one)."""
        children = tree_children(draft.tree.parent_ids)
        path, node = [0], 0
        for token in committed:
            node = next((c for c in children[node] if draft.tree.token_ids[c] == token), -1)
            if node < 0:
                break
            path.append(node)
        rest = committed[len(path) - 1 :]
        return cls(draft, tuple(path), rest[0] if rest else None)

    @property
    def accepted_token_ids(self) -> list[int]:
        """Tokens of the accepted path, root excluded."""
        return [self.draft.tree.token_ids[i] for i in self.accepted_nodes[1:]]

    @property
    def emitted_token_ids(self) -> list[int]:
        """What the round commits: the accepted path, then the next token."""
        tokens = self.accepted_token_ids
        return tokens if self.next_token is None else [*tokens, self.next_token]

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens accepted: a target-rooted path starts with the target's own candidate."""
        return max(0, len(self.accepted_nodes) - 1 - min(1, self.draft.num_seeded))

    @property
    def num_suffix_draft_tokens(self) -> int:
        return len(self.draft.suffix_nodes)

    @property
    def num_suffix_accepted_tokens(self) -> int:
        return sum(1 for node in self.accepted_nodes if node in self.draft.suffix_nodes)
