"""From target logits over a draft tree to the accepted path: dispatch to the right verify rule."""

from __future__ import annotations

import torch

from specserve.core.protocols import DraftTree
from specserve.core.rng import make_generator
from specserve.core.sampling import logits_to_probs, sample_token
from specserve.core.sampling_params import SamplingParams
from specserve.core.verify import VerifyOutcome, verify_greedy, verify_sampled


def accept_draft(
    target_logits: torch.Tensor,  # [N, V], row i = target's next-token logits after node i
    draft: DraftTree,
    params: SamplingParams,
    seed: int,
) -> VerifyOutcome:
    tree = draft.tree
    if params.greedy:
        return verify_greedy(target_logits.argmax(-1).tolist(), tree.parent_ids, tree.token_ids)
    generator = make_generator(seed)
    # Seeded generators live on the CPU, so sampling happens there: a seed gives the same tokens on any
    # device, and only the rows verification visits are copied.
    return verify_sampled(
        lambda node: logits_to_probs(target_logits[node].cpu(), params),
        tree.parent_ids,
        tree.token_ids,
        draft.draft_probs,
        draft.kind,
        generator,
    )


def choose_token(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """logits: [V] -> the next token under `params` (argmax when greedy)."""
    if params.greedy:
        return int(logits.argmax())
    return sample_token(logits_to_probs(logits.cpu(), params), make_generator(seed))
