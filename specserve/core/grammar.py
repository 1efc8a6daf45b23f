"""Drafts under a constraint: what the language forbids is never proposed, what it forces is free.

The target's side (its distribution masked at every verified node) keeps a constrained generation
lossless whatever is drafted; these functions only make drafts worth verifying. They work on a
`GrammarState`, a session's place in its language (specserve/grammar/guide.py implements it).

- `forced_draft`: where the language allows one continuation (a key, a separator, a bracket), the
  round drafts exactly that, in the tokenizer's canonical tokens, with no draft model.
- `shape_draft`: a drafter's tree of fixed candidates loses the nodes the language forbids (and their
  subtrees), and its spine (first children down) grows by what the language forces after it, up to the
  node cap. A tree
  of sampled candidates is left as drawn: dropping a draw would change the distribution the
  acceptance rule assumes its candidates came from (the target's mask rejects a forbidden draw anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.tree import TokenTree, tree_children


class GrammarState(Protocol):
    max_tree_nodes: int  # the most nodes a shaped draft may have

    def sync(self, token_ids: Sequence[int]) -> None:
        """Catches up with the committed tokens (prompt, then generated)."""
        ...

    def push(self, tokens: Sequence[int]) -> None: ...

    def pop(self, count: int) -> None: ...

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the language allows."""
        ...

    def forced(self) -> list[int]:
        """The continuation the language forces from here (empty when it allows a choice)."""
        ...

    def bitmask(self) -> bytes:
        """The tokens allowed next: bit i of little-endian 32-bit words is token i."""
        ...


@runtime_checkable
class ConstrainedDrafter(Protocol):
    """A drafter that masks its own distribution by the session's language while it drafts, so it never
    draws what the language forbids (runtime/drafter.py's spine drafters)."""

    def constrain(self, grammar: GrammarState) -> None:
        """`grammar`: the drafter's own place in the session's language (it syncs it with the tokens
        each round is proposed for, and returns it there)."""
        ...


def forced_draft(root_token: int, state: GrammarState) -> DraftTree | None:
    """The chain of what the language forces after the committed text, or None when it allows a choice."""
    forced = state.forced()[: max(0, state.max_tree_nodes - 1)]
    if not forced:
        return None
    return DraftTree(
        TokenTree.chain([root_token, *forced]), forced_nodes=frozenset(range(1, len(forced) + 1))
    )


def shape_draft(draft: DraftTree, state: GrammarState) -> DraftTree:
    """`draft` without what the language forbids, its leaves extended by what it forces (fixed
    candidates only; see the module's docstring)."""
    if draft.kind is not CandidateKind.FIXED or draft.target_roots:
        return draft
    tree = draft.tree
    children = tree_children(tree.parent_ids)
    kept: list[int] = []  # old node ids, in a topological order (a parent before its children)
    parents: list[int] = []  # new parent index of each kept node
    forced: list[int] = []  # new ids of forced extensions
    tokens: list[int] = []
    budget = max(1, state.max_tree_nodes)

    def add(token: int, parent: int, old: int) -> int:
        tokens.append(token)
        parents.append(parent)
        kept.append(old)
        return len(tokens) - 1

    def visit(old: int, new: int, on_spine: bool) -> None:
        grew = False
        for child in children[old]:
            if len(tokens) >= budget:
                return
            token = tree.token_ids[child]
            if state.allowed_prefix([token]) != 1:
                continue
            new_child = add(token, new, child)
            state.push([token])
            try:
                visit(child, new_child, on_spine and not grew)
            finally:
                state.pop(1)
            grew = True
        if on_spine and not grew:
            # The spine's leaf (the drafter's best path, first children down): what the language forces
            # after it comes free. Only there: forced tails on every leaf would multiply a tree's size.
            parent = new
            for token in state.forced()[: budget - len(tokens)]:
                parent = add(token, parent, -1)
                forced.append(parent)

    add(tree.token_ids[0], -1, 0)
    visit(0, 0, True)
    if kept == list(range(tree.num_nodes)):
        return draft
    old_to_new = {old: new for new, old in enumerate(kept) if old >= 0}
    return DraftTree(
        TokenTree(tuple(tokens), tuple(parents)),
        kind=draft.kind,
        suffix_nodes=frozenset(old_to_new[n] for n in draft.suffix_nodes if n in old_to_new),
        forced_nodes=frozenset(forced)
        | frozenset(old_to_new[n] for n in draft.forced_nodes if n in old_to_new),
    )
