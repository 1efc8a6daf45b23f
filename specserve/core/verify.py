"""Deciding which draft tokens the target accepts. Tensors in, node indices out; never sees a model.

Three rules, all lossless (the emitted tokens follow the target's distribution exactly):
- greedy: a child is accepted iff its token is the target's argmax at its parent.
- sampled candidates (SpecInfer/MCSD rule): children drawn from q are tried in the order they were
  drawn; accept x with probability min(1, p[x]/q[x]); on rejection p becomes the residual
  norm(max(p - q, 0)) and, for draws without replacement, x is removed from q.
- fixed candidates (EAGLE-2 rule, for deterministic proposals such as greedy drafts or CaPE top-k):
  accept x with probability p[x]; on rejection set p[x] = 0 and renormalise. No q is needed.
When no child is accepted, the next token is drawn from what is left of p (recovered token); at a leaf
it is drawn from p itself (bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from specserve.core.protocols import CandidateKind, VerifyOutcome
from specserve.core.sampling import sample_token, sample_without_replacement, uniform
from specserve.core.tree import tree_children


def verify_greedy(
    target_argmax: Callable[[int], int],  # node -> the target's argmax there (asked along the walk only)
    parent_ids: tuple[int, ...] | list[int],
    token_ids: tuple[int, ...] | list[int],
) -> VerifyOutcome:
    children = tree_children(parent_ids)
    node, path = 0, [0]
    while True:
        wanted = target_argmax(node)
        match = next((c for c in children[node] if token_ids[c] == wanted), None)
        if match is None:
            return VerifyOutcome(path, wanted)
        node = match
        path.append(node)


def verify_sampled(
    target_probs: Callable[[int], torch.Tensor],  # node -> p [V] at that node
    parent_ids: tuple[int, ...] | list[int],
    token_ids: tuple[int, ...] | list[int],
    draft_probs: Mapping[int, torch.Tensor],  # internal node -> q [V] its children were drawn from
    kind: CandidateKind,
    generator: torch.Generator,
) -> VerifyOutcome:
    path, p = _walk(target_probs, tree_children(parent_ids), token_ids, draft_probs, kind, generator, 0)
    return VerifyOutcome(path, sample_token(p, generator))


def verify_target_rooted(
    target_probs: Callable[[int], torch.Tensor],  # node -> p [V] at that node
    parent_ids: tuple[int, ...] | list[int],
    token_ids: tuple[int, ...] | list[int],
    draft_probs: Mapping[int, torch.Tensor],  # internal node below the roots -> q [V]
    kind: CandidateKind,
    generator: torch.Generator,
    num_candidates: int,
) -> VerifyOutcome:
    """Target-initialised MCSD at T > 0 (Lu et al. 4.2a). LOSSY: biased toward roots whose drafts go far.

    Node 0's children are the target's own root candidates (W samples without replacement from its
    distribution there, drawn last round). Each root's subtree is verified with the lossless rule on its
    own, and the root whose accepted path is longest wins (the first in sampling order on ties), so the
    root token follows p(t) * P(its continuation is accepted | t) rather than p: section 5.3's "never".
    Instead of a bonus token, W candidates for the next position are drawn without replacement from the
    distribution the lossless rule would sample it from. Without root candidates (the first round) node 0
    itself is that position.
    """
    children = tree_children(parent_ids)
    path, p = [0], target_probs(0)
    best = -1
    for root in children[0]:
        branch, branch_p = _walk(target_probs, children, token_ids, draft_probs, kind, generator, root)
        if len(branch) > best:
            best, path, p = len(branch), [0, *branch], branch_p
    count = min(num_candidates, int((p > 0).sum()))
    candidates = sample_without_replacement(p, count, generator)
    return VerifyOutcome(path, None, tuple(candidates))


def _walk(
    target_probs: Callable[[int], torch.Tensor],
    children: list[list[int]],
    token_ids: tuple[int, ...] | list[int],
    draft_probs: Mapping[int, torch.Tensor],
    kind: CandidateKind,
    generator: torch.Generator,
    start: int,
) -> tuple[list[int], torch.Tensor]:
    """The lossless rule from `start` down: (accepted path from `start`, the distribution [V] the next
    token is to be drawn from: p at a leaf, what is left of it after rejections)."""
    node, path = start, [start]
    while True:
        p = target_probs(node)
        if not children[node]:
            return path, p
        if kind is CandidateKind.FIXED:
            accepted, p = _try_fixed(p, [token_ids[c] for c in children[node]], generator)
        else:
            accepted, p = _try_sampled(
                p,
                draft_probs[node],
                [token_ids[c] for c in children[node]],
                kind is CandidateKind.SAMPLED_WITHOUT_REPLACEMENT,
                generator,
            )
        if accepted is None:
            return path, p
        node = children[node][accepted]
        path.append(node)


def _try_sampled(
    p: torch.Tensor,  # [V]
    q: torch.Tensor,  # [V]
    candidates: list[int],
    without_replacement: bool,
    generator: torch.Generator,
) -> tuple[int | None, torch.Tensor]:
    """Returns (index of the accepted candidate or None, the distribution left to sample from)."""
    p, q = p.clone(), q.clone()
    for i, x in enumerate(candidates):
        px, qx = float(p[x]), float(q[x])
        # px > 0: a token the target cannot emit (a constraint masked it) is never accepted, even by a
        # zero uniform draw.
        if qx > 0 and px > 0 and uniform(generator) * qx <= px:
            return i, p
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        # total == 0 means p <= q everywhere, i.e. p == q, where rejection has probability 0.
        if total > 0:
            p = residual / total
        if without_replacement:
            q[x] = 0
            q_total = float(q.sum())
            q = q / q_total if q_total > 0 else _uniform_over_untried(q, candidates[: i + 1])
    return None, p


def _uniform_over_untried(q: torch.Tensor, tried: list[int]) -> torch.Tensor:
    out = torch.ones_like(q)
    out[tried] = 0
    return out / out.sum()


def _try_fixed(
    p: torch.Tensor, candidates: list[int], generator: torch.Generator
) -> tuple[int | None, torch.Tensor]:
    p = p.clone()
    for i, x in enumerate(candidates):
        if uniform(generator) <= float(p[x]) and float(p[x]) > 0:
            return i, p
        p[x] = 0
        total = float(p.sum())
        if total <= 0:  # every token with mass was tried and rejected: impossible unless p[x] ~ 1
            break
        p = p / total
    return None, p
