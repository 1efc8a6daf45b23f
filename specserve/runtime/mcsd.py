"""Multi-candidate speculative decoding (MCSD, Yang et al., arXiv 2401.06706) and its target-initialised
variant (Lu et al., arXiv 2409.10644, 4.2a), with a draft causal LM grown level by level.

MCSD: with k_config = (k_1, ..., k_gamma) every node at depth d - 1 gets k_d children: at T > 0 drawn
from the draft's processed distribution q (with or without replacement; the verifier then applies the
lossless multi-candidate rule of core/verify.py), at T = 0 the draft's top-k_d. Nodes are numbered level by
level, so the whole tree's mask is built once per shape (core/sliced_mask.py) and a round that a stop
policy ends after j levels uses its top-left block. Each level is one draft forward: its nodes see the
committed prefix and, through the sliced mask, their ancestors among the levels already in the draft cache.

Target-initialised (target_roots = W): the W children of the root are the target's own candidates for
that position, handed over by the verifier (top-W at T = 0; W samples without replacement at T > 0) in
place of a bonus token; the draft grows the remaining levels under them. Exact at T = 0, biased at T > 0
(core/verify.py, verify_target_rooted), so methods using it are marked lossy.

Worked example, k_config (2, 2, 1): the root's 2 children (level 1), 2 under each (level 2), 1 under each
of those (level 3): 1 + 2 + 4 + 4 = 11 nodes from 3 draft forwards (root, level 1, level 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling import logits_to_probs, make_generator, sample_without_replacement
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.sliced_mask import SlicedTreeMask, sliced_tree_mask
from specserve.core.stopping import DraftStep, StopPolicy, StopPolicyName, StopSettings
from specserve.core.tree import TokenTree
from specserve.errors import InvalidArgument
from specserve.runtime.drafter import PolicyDrafter, sync_draft_cache
from specserve.runtime.runner import ModelRunner
from specserve.runtime.stopper import make_stop_policy


@dataclass(frozen=True)
class McsdShape:
    k_config: tuple[int, ...] = (2, 2, 1)  # children per node at each depth; level 1 = the root's
    sampled_kind: CandidateKind = CandidateKind.SAMPLED  # candidate rule at T > 0
    stop: StopPolicyName = StopPolicyName.FIXED  # may end a round after fewer levels
    stop_settings: StopSettings | None = None
    target_roots: bool = False  # level 1 (k_config[0] = W) comes from the target

    def __post_init__(self) -> None:
        sliced_tree_mask(self.k_config)  # validates the shape
        if self.target_roots and self.stop != StopPolicyName.FIXED:
            # A stop policy learns from the drafted spine; here the first spine token is the target's.
            raise InvalidArgument("target-initialised MCSD drafts its whole shape; use the fixed policy")

    def new_stop_policy(self) -> StopPolicy:
        settings = self.stop_settings if self.stop_settings is not None else StopSettings()
        if self.stop == StopPolicyName.FIXED:
            settings = replace(settings, fixed_depth=len(self.k_config))
        return make_stop_policy(self.stop, settings)


class MultiCandidateDrafter(PolicyDrafter):
    """Satisfies Drafter and, for target-initialised shapes, RootSeededDrafter."""

    def __init__(
        self, runner: ModelRunner, capacity: int, shape: McsdShape, sampling: SamplingParams = GREEDY
    ) -> None:
        super().__init__(shape.sampled_kind, shape.new_stop_policy(), sampling)
        self.runner = runner
        self.shape = shape
        full = sliced_tree_mask(shape.k_config)
        self.cache = runner.new_cache(capacity + full.num_nodes(full.gamma))
        self._cached_ids: list[int] = []  # committed tokens (root included) whose KV the cache holds

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        if self.shape.target_roots:
            # The first round has no root candidates yet: the verifier's forward over the root alone
            # produces them (one target forward that commits no token).
            return DraftTree(TokenTree.chain([token_ids[-1]]), target_roots=self.shape.k_config[0])
        return super().propose(token_ids, round_seed, batch_sessions)

    def _draft(self, token_ids: Sequence[int], generator: torch.Generator) -> DraftTree:
        return self._grow(token_ids, (), generator)

    def propose_from_roots(
        self, token_ids: Sequence[int], root_candidates: Sequence[int], round_seed: int, batch_sessions: int
    ) -> DraftTree:
        if not self.shape.target_roots:
            raise InvalidArgument("this MCSD shape is not target-initialised")
        if not 1 <= len(root_candidates) <= self.shape.k_config[0]:
            raise InvalidArgument(
                f"need 1..{self.shape.k_config[0]} root candidates, got {len(root_candidates)}"
            )
        self.open_round(token_ids, batch_sessions)  # a RoundPolicy sizes each round, this one too
        return self._grow(token_ids, tuple(root_candidates), make_generator(round_seed))

    @torch.inference_mode()
    def _grow(
        self, token_ids: Sequence[int], roots: tuple[int, ...], generator: torch.Generator
    ) -> DraftTree:
        k_config = (len(roots), *self.shape.k_config[1:]) if roots else self.shape.k_config
        sliced = sliced_tree_mask(k_config)  # cached per shape: a mask build once, a slice per round
        prefix = len(token_ids) - 1  # the root's cache slot; node i sits at prefix + i
        # [1, V]: after each node of the current level
        level_logits = sync_draft_cache(self.runner, self.cache, self._cached_ids, token_ids)[None]
        nodes: list[int] = [token_ids[-1]]
        draft_probs: dict[int, torch.Tensor] = {}
        levels = min(sliced.gamma, self.stop_policy.max_depth)
        drafted = 0
        for d in range(levels):
            level_start = sliced.level_ends[d - 1] if d else 0
            for local, logits in enumerate(level_logits):
                if d == 0 and roots:
                    nodes.extend(roots)
                    continue
                children, q = self._children(logits, self.sampling, self.kind, k_config[d], generator)
                nodes.extend(children)
                if q is not None:
                    draft_probs[level_start + local] = q
            drafted = d + 1
            seeded = d == 0 and bool(roots)
            spine_step = DraftStep(d, level_logits[0], nodes[sliced.level_ends[d]])
            if drafted == levels or (not seeded and self.stop_policy.should_stop(spine_step)):
                break
            level_logits = self._forward_level(sliced, d + 1, nodes, prefix)  # [k, V]
        self.cache.truncate(prefix + 1)  # drop the tree; the root stays (it is committed)
        tree = TokenTree(tuple(nodes), sliced.levels(drafted).parent_ids)
        return DraftTree(tree, self.kind, draft_probs, target_roots=self.shape.k_config[0] if roots else 0)

    def _forward_level(
        self, sliced: SlicedTreeMask, level: int, nodes: list[int], prefix: int
    ) -> torch.Tensor:
        """Appends the nodes of `level` to the draft cache; returns their logits [n, V]."""
        start, end = sliced.level_ends[level - 1], sliced.level_ends[level]
        assert self.cache.length == prefix + start, "levels go into the cache in order"
        seen = torch.ones(end - start, prefix, dtype=torch.bool)  # [n, prefix]: committed tokens
        attend = torch.cat([seen, sliced.mask[start:end, :end]], dim=1)  # [n, prefix + end]
        positions = prefix + sliced.depths[start:end]  # [n]
        return self.runner.forward_masked(self.cache, nodes[start:end], positions, attend)

    @staticmethod
    def _children(
        logits: torch.Tensor, params: SamplingParams, kind: CandidateKind, k: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """Exactly k children (the shape is static) and q when the verifier needs it."""
        if params.greedy:
            return torch.topk(logits, k).indices.tolist(), None
        q = logits_to_probs(logits.cpu(), params)  # [V], on the CPU like the verifier's p
        if kind is CandidateKind.FIXED:
            return torch.topk(q, k).indices.tolist(), None
        if kind is CandidateKind.SAMPLED:
            return torch.multinomial(q, k, replacement=True, generator=generator).tolist(), q
        return sample_without_replacement(q, k, generator), q

    def release(self) -> None:
        self.cache.truncate(0)
        self._cached_ids.clear()
        self._feedback.reset()
