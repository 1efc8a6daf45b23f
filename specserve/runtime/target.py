"""The in-process verifier: one sequence's target KV cache, verification and commit."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from specserve.core.accept import accept_draft, choose_token
from specserve.core.protocols import DraftTree, VerifyOutcome
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.grammar.guide import Guide
from specserve.grammar.masks import PathMasks, allowed_tokens
from specserve.runtime.prefix_cache import PrefixCache, blocks_fit
from specserve.runtime.runner import ModelRunner

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per forward: bounds how long a prefill holds up decoding


class LocalVerifier:
    """Target state of one sequence. The cache holds every committed token but the newest (the root).

    commit_lock guards what readers on other threads see (token_ids, committed_length): it is held only
    while a result is committed, never across a forward, so concurrent sessions' forwards can batch.
    Prompts are prefilled `prefill_chunk` tokens per forward, so other sessions keep decoding between.
    With a `guide` (a constraint), the first token and every verified node are chosen from the target's
    distribution masked to what the constraint allows there (specserve/grammar/masks.py).
    With a `prefix_cache`, a prefill starts from the longest prefix `tenant` has cached and caches what
    it computed (runtime/prefix_cache.py).
    """

    def __init__(
        self,
        runner: ModelRunner,
        capacity: int,
        commit_lock: AbstractContextManager[object] | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        sampling: SamplingParams = GREEDY,
        prefix_cache: PrefixCache | None = None,
        tenant: str = "",
        guide: Guide | None = None,
    ) -> None:
        if prefix_cache is not None and not blocks_fit(
            prefix_cache.block_tokens, prefill_chunk, runner.rows_independent
        ):
            # Measured: on a dense model blocks smaller than a chunk start a chunk where a cold prefill
            # does not, and the K/V then differ in their last bits (runtime/prefix_cache.py).
            raise InvalidArgument(
                f"prefix cache blocks ({prefix_cache.block_tokens} tokens) must equal the prefill "
                f"chunk ({prefill_chunk}): a cached prefix must end where a cold prefill's chunk does"
            )
        self.prefix_cache = prefix_cache
        self.tenant = tenant  # whose cached prefixes this session may read and extend
        self.runner = runner
        self.sampling = sampling  # the session's, fixed
        self.guide = guide
        self.cache = runner.new_cache(capacity)
        self.commit_lock = commit_lock if commit_lock is not None else threading.RLock()
        self.prefill_chunk = prefill_chunk
        # Every committed token, the root last: len(token_ids) == cache.length + 1 once prefilled. The
        # service's KV feed sends them with the KV so a draft can start the next round on its own.
        self.token_ids: list[int] = []
        # The logits of the last prefill ([V]) or verify ([N, V]), kept only when a caller asks for
        # log-probabilities of what it committed (core/logprobs.py); None otherwise.
        self.keep_logits = False
        self.last_logits: torch.Tensor | None = None
        self.cached_tokens = 0  # of the last prefill or rebuild, positions loaded from the prefix cache

    @property
    def committed_length(self) -> int:
        """Positions of committed KV (every committed token but the root); stable while a forward runs."""
        return max(0, len(self.token_ids) - 1)

    def _encode(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Prefills `token_ids` from an empty cache in chunks; returns the logits after the last, [V].

        Chunks end at absolute multiples of `prefill_chunk` and a cached prefix is whole chunks, so every
        position is computed by the same forward as in a cold prefill; or the runner's rows are
        independent, and a position's bits do not depend on the forward (runtime/prefix_cache.py says
        why either keeps the output bit for bit)."""
        self.cache.truncate(0)
        start = self.cached_tokens = self._load_cached_prefix(token_ids)
        logits = None
        while start < len(token_ids):
            end = min(len(token_ids), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            logits = self.runner.forward(self.cache, token_ids[start:end], last_only=True)
            start = end
        assert logits is not None, "nothing to encode"
        if self.prefix_cache is not None:
            self.prefix_cache.insert(self.tenant, token_ids, self.cache)
        return logits

    def _load_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Loads the longest cached prefix, leaving at least the last token to compute (its logits)."""
        if self.prefix_cache is None:
            return 0
        features = None if self.cache.features is None else self.cache.features.layers
        lease = self.prefix_cache.acquire(self.tenant, token_ids, len(token_ids) - 1, features)
        try:
            return self.prefix_cache.load(lease, self.cache)
        finally:
            self.prefix_cache.release(lease)

    @property
    def root_token(self) -> int | None:
        return self.token_ids[-1] if self.token_ids else None

    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        logits = self._encode(prompt_ids)  # [V]
        self.last_logits = logits if self.keep_logits else None
        allowed = None
        if self.guide is not None:
            allowed = allowed_tokens(self.guide.bitmask(), logits.shape[-1], logits.device)
        root = choose_token(logits, self.sampling, round_seed, allowed)
        with self.commit_lock:
            self.token_ids = [*prompt_ids, root]
        if self.guide is not None:
            self.guide.sync(self.token_ids)
        return root

    def resume(self, token_ids: Sequence[int]) -> None:
        """Rebuilds the state after committed `token_ids` (the last is the root) without choosing anything:
        a target that lost a session's KV continues it exactly where it was."""
        if len(token_ids) > 1:
            self._encode(token_ids[:-1])
        else:
            self.cache.truncate(0)
            self.cached_tokens = 0
        with self.commit_lock:
            self.token_ids = list(token_ids)
        if self.guide is not None:
            self.guide.sync(self.token_ids)

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        tree = draft.tree
        if tree.token_ids[0] != self.root_token:
            raise FailedPrecondition(
                f"draft root {tree.token_ids[0]} is not the last committed token {self.root_token}"
            )
        start = self.cache.length
        logits = self.runner.forward(
            self.cache, tree.token_ids, None if tree.is_chain() else tree.parent_ids
        )  # [N, V]
        self.last_logits = logits if self.keep_logits else None
        masks = None
        if self.guide is not None:
            self.guide.sync(self.token_ids)
            masks = PathMasks(self.guide, tree, logits.shape[-1], logits.device)
        outcome = accept_draft(logits, draft, self.sampling, round_seed, masks)
        accepted = [tree.token_ids[i] for i in outcome.accepted_nodes[1:]]
        with self.commit_lock:
            self.cache.commit_path(start, outcome.accepted_nodes)
            if outcome.next_token is None:
                # Target-rooted: no token after the path is committed, so the path's last token becomes
                # the next root, and a root's KV is computed by the round that verifies it (once more).
                self.cache.truncate(start + len(outcome.accepted_nodes) - 1)
                self.token_ids = [*self.token_ids, *accepted]
            else:
                self.token_ids = [*self.token_ids, *accepted, outcome.next_token]
        if self.guide is not None:
            self.guide.sync(self.token_ids)  # the walk pushed the accepted path; this adds the next token
        return outcome

    def release(self) -> None:
        with self.commit_lock:
            self.cache.truncate(0)
            self.token_ids = []
