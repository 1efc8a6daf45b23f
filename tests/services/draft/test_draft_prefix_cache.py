"""The draft's prefix cache of mirrored prompt K/V, in process on the tiny target.

A session whose prompt starts with cached blocks loads them into its mirror and is fed only the positions
after them: its mirror must then hold exactly what a mirror fed from position 0 holds, so its drafts,
and the target's acceptance of them, are those of a session without the cache. Blocks serve only their
tenant (and target, and kind of mirror), and the cache stays within its budget under a flood of prompts.
"""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_model

from services.draft.mirror import KVMirror
from services.draft.prefix import MirrorPrefixCache, MirrorScope, PendingPrompt
from services.target.feed import kv_feed
from services.target.sessions import SessionStore
from specserve.core.cape import CapeSettings
from specserve.core.sampling_params import GREEDY
from specserve.core.tree import TokenTree
from specserve.glide import GlideDrafter, build_glide
from specserve.models.tiny import Architecture
from specserve.runtime.drafter import DraftShape
from specserve.runtime.runner import ModelRunner

CHUNK = 8  # the target's prefill chunk, and so the block
CAPACITY = 128
DOCUMENT = [(7 * i + 3) % 60 + 2 for i in range(27)]  # three whole blocks and three tokens
TARGET = "target-a:50051"
SHAPE = DraftShape(depth=3)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(tiny_model(Architecture.LLAMA))


@pytest.fixture(scope="module")
def glide(runner):
    draft = build_glide(runner.model, seed=0)
    draft.init_weights(torch.Generator().manual_seed(0), std=0.3)  # confident enough to draft trees
    return draft


@pytest.fixture
def store(runner) -> SessionStore:
    # The target keeps its own prefix cache, on in every run: only the draft's is switched.
    return SessionStore(runner, 16, 4096, prefill_chunk=CHUNK, prefix_cache_bytes=1 << 30)


class MirroredSession:
    """A target session and its draft-side mirror, fed as the draft service feeds it."""

    def __init__(
        self,
        store: SessionStore,
        cache: MirrorPrefixCache,
        session_id: str,
        prompt: list[int],
        tenant: str = "a",
        target: str = TARGET,
        hidden_states: bool = False,
    ) -> None:
        self.store, self.session_id, self.hidden_states = store, session_id, hidden_states
        with store.lock:
            self.target = store.create(session_id, CAPACITY, len(prompt), GREEDY, tenant)
        if hidden_states:
            self.target.verifier.cache.keep_features()
        self.target.verifier.prefill(prompt, 0)
        num_layers = store.runner.model.config.num_hidden_layers
        self.mirror = KVMirror([] if hidden_states else [-1], num_layers, CAPACITY, store.runner.device)
        if hidden_states:
            self.mirror.keep_features()
        scope = MirrorScope.of(tenant, target, self.mirror)
        token_ids = self.target.verifier.token_ids
        self.cached, self.pending = cache.load(CHUNK, scope, self.mirror, token_ids, len(prompt))

    def follow(self) -> None:
        """Mirrors every committed position, from the first the mirror lacks (as a subscription does)."""
        committed = self.target.committed_length
        layers = [] if self.hidden_states else [self.store.runner.model.config.num_hidden_layers - 1]
        for chunk in kv_feed(
            self.store,
            self.session_id,
            self.mirror.length,
            layers,
            5,
            lambda: self.mirror.length < committed,
            hidden_states=self.hidden_states,
        ):
            self.mirror.write(chunk)
            if self.pending is not None:
                MirrorPrefixCache.offer(self.pending, self.mirror)

    def run_rounds(self, glide, rounds: int) -> list[tuple[int, TokenTree]]:
        """GliDe rounds drafted from the mirror and verified by the target: per round, the tokens accepted
        and the tree drafted."""
        drafter = GlideDrafter(glide, self.mirror, CAPACITY, SHAPE, CapeSettings())
        verifier = self.target.verifier
        rounds_run = []
        for round_seed in range(rounds):
            self.follow()
            self.mirror.visible = len(verifier.token_ids) - 1  # as the servicer sets it for the round
            draft = drafter.propose(verifier.token_ids, round_seed, 1)
            outcome = verifier.verify(draft, round_seed)
            rounds_run.append((len(outcome.accepted_nodes) - 1, draft.tree))
        self.follow()
        return rounds_run

    def mirrored(self) -> list[torch.Tensor]:
        self.mirror.visible = self.mirror.length
        if self.hidden_states:
            return [self.mirror.hidden_states()]
        return list(self.mirror.layer_kv(-1))


def question(i: int) -> list[int]:
    return [*DOCUMENT, 40 + i, 41, 42]


def test_a_cached_prefix_drafts_and_is_accepted_as_a_fed_one(store, glide) -> None:
    runs = {}
    for budget in (0, 1 << 30):
        cache = MirrorPrefixCache(budget)
        first = MirroredSession(store, cache, f"first-{budget}", question(0))
        first.run_rounds(glide, 4)
        second = MirroredSession(store, cache, f"second-{budget}", question(1))
        runs[budget] = (second.cached, second.run_rounds(glide, 6), second.target.verifier.token_ids, second)
    (cold, cold_accepted, cold_tokens, cold_session) = runs[0]
    (warm, warm_accepted, warm_tokens, warm_session) = runs[1 << 30]
    assert (cold, warm) == (0, 3 * CHUNK)  # the document's whole blocks
    assert warm_tokens == cold_tokens
    assert warm_accepted == cold_accepted  # the same acceptance counts, from the same trees
    assert all(tree.num_nodes > SHAPE.depth + 1 for _, tree in warm_accepted)  # trees, not chains
    for warm_tensor, cold_tensor in zip(warm_session.mirrored(), cold_session.mirrored(), strict=True):
        assert torch.equal(warm_tensor, cold_tensor)


def test_hidden_states_are_cached_for_a_hidden_state_drafts_mirror(store) -> None:
    cache = MirrorPrefixCache(1 << 30)
    MirroredSession(store, cache, "h-first", question(0), hidden_states=True).follow()
    warm = MirroredSession(store, cache, "h-warm", question(1), hidden_states=True)
    cold = MirroredSession(store, MirrorPrefixCache(0), "h-cold", question(1), hidden_states=True)
    assert (warm.cached, cold.cached) == (3 * CHUNK, 0)
    warm.follow()
    cold.follow()
    assert torch.equal(warm.mirrored()[0], cold.mirrored()[0])
    # A GliDe mirror of the same prompt holds K/V, not hidden states: it reuses none of these blocks.
    assert MirroredSession(store, cache, "kv", question(1)).cached == 0


def test_a_tenant_never_reuses_another_tenants_blocks(store) -> None:
    cache = MirrorPrefixCache(1 << 30)
    MirroredSession(store, cache, "a-first", question(0), tenant="a").follow()
    assert MirroredSession(store, cache, "b-same", question(0), tenant="b").cached == 0
    assert MirroredSession(store, cache, "a-again", question(1), tenant="a").cached == 3 * CHUNK
    # Nor a session of the same tenant on another target replica (its feed would have sent its own).
    assert MirroredSession(store, cache, "a-elsewhere", question(1), target="target-b:50051").cached == 0


def test_only_the_prompts_whole_blocks_are_cached(store, glide) -> None:
    cache = MirrorPrefixCache(1 << 30)
    first = MirroredSession(store, cache, "gen", question(0))
    first.run_rounds(glide, 4)  # generated positions (verify forwards) are mirrored too, never cached
    assert cache.cache is not None and len(cache.cache) == 3
    assert first.pending is not None and first.pending.done
    assert MirroredSession(store, cache, "short", DOCUMENT[: CHUNK - 1]).pending is None


def test_a_flood_of_prompts_stays_in_budget_around_sessions_loading(store) -> None:
    probe = MirrorPrefixCache(1 << 30)
    MirroredSession(store, probe, "probe", question(0)).follow()
    assert probe.cache is not None
    block_bytes = probe.cache.used_bytes // len(probe.cache)
    cache = MirrorPrefixCache(5 * block_bytes)
    kept = MirroredSession(store, cache, "kept", question(0))
    kept.follow()
    prefix = cache.for_block(CHUNK)
    assert prefix is not None
    # A session loading its prefix pins the blocks until they are in its mirror.
    scope = MirrorScope.of("a", TARGET, kept.mirror)
    lease = prefix.acquire(scope.key, question(0), len(DOCUMENT), None)
    assert lease.num_tokens == 3 * CHUNK
    in_flight: list[MirroredSession] = []
    for i in range(12):
        prompt = [(11 * i + 5 * j + 1) % 60 + 2 for j in range(3 * CHUNK + 2)]
        session = MirroredSession(store, cache, f"flood-{i}", prompt)
        in_flight.append(session)
        if i % 2:  # every other session is mirrored at once; the rest insert after the flood
            session.follow()
        assert prefix.used_bytes <= prefix.budget_bytes
    for session in in_flight:
        session.follow()
        assert prefix.used_bytes <= prefix.budget_bytes
    loaded = KVMirror([-1], kept.mirror.num_layers, CAPACITY, kept.mirror.device)
    loaded.load_prefix(lease.kv(), None)
    prefix.release(lease)
    loaded.visible = kept.mirror.visible = 3 * CHUNK
    for cached, fed in zip(loaded.layer_kv(-1), kept.mirror.layer_kv(-1), strict=True):
        assert torch.equal(cached, fed)
    assert prefix.stats.evicted_blocks > 0
    assert prefix.used_bytes <= prefix.budget_bytes


def test_a_pending_prompt_waits_for_its_blocks(store) -> None:
    cache = MirrorPrefixCache(1 << 30)
    session = MirroredSession(store, cache, "wait", question(0))
    assert isinstance(session.pending, PendingPrompt) and not session.pending.done
    MirrorPrefixCache.offer(session.pending, session.mirror)  # nothing mirrored yet: nothing cached
    assert cache.cache is not None and len(cache.cache) == 0 and not session.pending.done
    session.follow()
    assert session.pending.done and len(cache.cache) == 3
