"""The KV feed into the draft's mirror, in process, on each architecture's tiny target.

The target's feed (services/target/feed.py) serialises committed K/V and final hidden states; the
draft's mirror (services/draft/mirror.py) rebuilds them. On a Qwen2 target the cached keys carry the
k_proj bias and are 2 heads of 16, twice hidden / heads: the mirror must hold exactly the target cache's
tensors, and a GliDe drafter reading it must propose what one reading the target's own cache proposes.
"""

from __future__ import annotations

import torch
from tiny_llama import EACH_ARCHITECTURE, tiny_model

from services.draft.mirror import KVMirror
from services.target.feed import kv_feed
from services.target.sessions import SessionStore
from specserve.core.cape import CapeSettings
from specserve.core.sampling_params import GREEDY
from specserve.glide import GlideDrafter, build_glide
from specserve.models.tiny import Architecture
from specserve.runtime.drafter import DraftShape
from specserve.runtime.runner import ModelRunner

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 128
SHAPE = DraftShape(depth=3)


@EACH_ARCHITECTURE
def test_the_mirror_holds_the_targets_kv_and_states_and_drafts_the_same(architecture: Architecture) -> None:
    runner = ModelRunner(tiny_model(architecture))
    config = runner.model.config
    glide = build_glide(runner.model, seed=0)
    glide.init_weights(torch.Generator().manual_seed(0), std=0.3)  # confident enough to draft trees
    store = SessionStore(runner, max_sessions=2, kv_budget_tokens=1024)
    with store.lock:
        session = store.create("s", CAPACITY, len(PROMPT), GREEDY)
    verifier = session.verifier
    verifier.cache.keep_features()  # what a session prefilled with keep_hidden_states does
    verifier.prefill(PROMPT, 0)
    local = GlideDrafter(glide, verifier.cache, CAPACITY, SHAPE, CapeSettings())
    for round_seed in range(3):  # rounds of tree verification: commits copy accepted paths down
        verifier.verify(local.propose(verifier.token_ids, round_seed, 1), round_seed)

    committed = session.committed_length
    last = config.num_hidden_layers - 1
    mirror = KVMirror([-1], config.num_hidden_layers, CAPACITY, runner.device)
    mirror.keep_features()
    chunks = kv_feed(store, "s", 0, [last], 5, lambda: mirror.length < committed, hidden_states=True)
    for chunk in chunks:
        assert (chunk.num_kv_heads, chunk.head_dim) == (config.num_key_value_heads, config.head_dim)
        mirror.write(chunk)
    mirror.visible = committed  # what the draft servicer sets for a round rooted after them

    for mirrored, cached in zip(mirror.layer_kv(-1), verifier.cache.layer_kv(last), strict=True):
        assert mirrored.shape == cached.shape == (1, config.num_key_value_heads, committed, config.head_dim)
        assert torch.equal(mirrored, cached)
    assert torch.equal(mirror.hidden_states(), verifier.cache.hidden_states())  # [1, L, H]

    remote = GlideDrafter(glide, mirror, CAPACITY, SHAPE, CapeSettings())
    fresh = GlideDrafter(glide, verifier.cache, CAPACITY, SHAPE, CapeSettings())
    proposed = remote.propose(verifier.token_ids, 7, 1)
    assert proposed.tree == fresh.propose(verifier.token_ids, 7, 1).tree
    assert proposed.tree.num_nodes > SHAPE.depth + 1  # a tree, not a chain
