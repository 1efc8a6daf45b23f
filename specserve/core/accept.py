"""From target logits over a draft tree to the accepted path: dispatch to the right verify rule."""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.core.protocols import DraftTree, VerifyOutcome
from specserve.core.sampling import logits_to_probs, make_generator, mask_disallowed, sample_token
from specserve.core.sampling_params import SamplingParams
from specserve.core.verify import verify_greedy, verify_sampled, verify_target_rooted


class NodeMasks(Protocol):
    """What a constraint allows after each node, asked along the verification walk only (node 0 first,
    then one child of the node asked last)."""

    def allowed(self, node: int) -> torch.Tensor:
        """[V] bool: the tokens allowed after `node`."""
        ...

    def allows(self, node: int, token: int) -> bool:
        """Whether `token` is allowed after `node` (without building the [V] mask)."""
        ...


def accept_draft(
    target_logits: torch.Tensor,  # [N, V], row i = target's next-token logits after node i
    draft: DraftTree,
    params: SamplingParams,
    seed: int,
    masks: NodeMasks | None = None,
) -> VerifyOutcome:
    """With `masks` (a constraint), each visited row is masked to what the constraint allows there
    before it is judged: the output is the target's own constrained decoding."""
    tree = draft.tree

    def row(node: int) -> torch.Tensor:  # [V]
        logits = target_logits[node]
        return logits if masks is None else mask_disallowed(logits, masks.allowed(node))

    if params.greedy:
        argmax: list[int] = target_logits.argmax(-1).tolist()  # [N], one call for all rows

        def choice(node: int) -> int:
            # The masked argmax is the first best allowed token: when the row's own first best token is
            # allowed it is that token, and no mask is built (most rows, under a JSON schema).
            if masks is None or masks.allows(node, argmax[node]):
                return argmax[node]
            return int(row(node).argmax())

        outcome = verify_greedy(choice, tree.parent_ids, tree.token_ids)
        if not draft.target_roots:
            return outcome
        # Exact at T = 0: the greedy path is the same, and the target's top-W starts with the argmax that
        # would have been the next token; the next round can only accept that one among them.
        last = row(outcome.accepted_nodes[-1])  # [V]
        candidates = torch.topk(last, min(draft.target_roots, last.shape[-1])).indices.tolist()
        return VerifyOutcome(outcome.accepted_nodes, None, tuple(candidates))
    generator = make_generator(seed)

    # Seeded generators live on the CPU, so sampling happens there: a seed gives the same tokens on any
    # device, and only the rows verification visits are copied.
    def target_probs(node: int) -> torch.Tensor:
        return logits_to_probs(row(node).cpu(), params)

    rule = (target_probs, tree.parent_ids, tree.token_ids, draft.draft_probs, draft.kind, generator)
    if draft.target_roots:
        return verify_target_rooted(*rule, draft.target_roots)
    return verify_sampled(*rule)


def choose_token(
    logits: torch.Tensor, params: SamplingParams, seed: int, allowed: torch.Tensor | None = None
) -> int:
    """logits: [V] -> the next token under `params` (argmax when greedy), among `allowed` [V] if given."""
    if allowed is not None:
        logits = mask_disallowed(logits, allowed)
    if params.greedy:
        return int(logits.argmax())
    return sample_token(logits_to_probs(logits.cpu(), params), make_generator(seed))
