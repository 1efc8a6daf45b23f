"""Log-probabilities of generated tokens under the target's own distribution, from a forward's logits.

What OpenAI-style `logprobs` report: the log-softmax of the raw logits (before temperature, top-k and
top-p), so a token's figure does not depend on how it was sampled. A verify forward over a tree has one
logits row per node; the token committed after node i is scored on row i. For an accepted path
[0, a1, a2] followed by next_token t, the rows are [0, a1, a2] and the tokens [tree[a1], tree[a2], t].

The target computes them here; what the router handles of them is torch-free: the bound in
core/request.py, the result type (`TokenLogprob`) in results.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.request import MAX_TOP_LOGPROBS
from specserve.results import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], num_top: int = 0
) -> list[TokenLogprob]:
    """logits: [N, V] (one row per position or tree node); token_ids[j] is scored on logits[rows[j]]."""
    if len(rows) != len(token_ids):
        raise ValueError(f"{len(rows)} rows for {len(token_ids)} tokens")
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    if not rows:
        return []
    logprobs = torch.log_softmax(logits[list(rows)].float(), dim=-1)  # [K, V]
    chosen = logprobs.gather(1, torch.tensor(list(token_ids), device=logprobs.device)[:, None])[:, 0]
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    result = []
    for j, token in enumerate(token_ids):
        top: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_values is not None:
            top = tuple(zip(top_ids[j].tolist(), top_values[j].tolist(), strict=True))
        result.append(TokenLogprob(int(token), float(chosen[j]), top))
    return result


def path_logprobs(
    logits: torch.Tensor,
    accepted_nodes: Sequence[int],
    tree_token_ids: Sequence[int],
    next_token: int | None,
    num_top: int = 0,
) -> list[TokenLogprob]:
    """The committed tokens of one verify round, in order: the accepted path after the root, then
    next_token (if any). logits: [num_nodes, V] of the tree forward."""
    tokens = [tree_token_ids[i] for i in accepted_nodes[1:]]
    rows = list(accepted_nodes[: len(tokens)])
    if next_token is not None:
        tokens.append(next_token)
        rows.append(accepted_nodes[-1])
    return token_logprobs(logits, rows, tokens, num_top)
