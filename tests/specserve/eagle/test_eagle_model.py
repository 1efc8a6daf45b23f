"""The hidden-state draft: its unrolled training forward equals drafting one token at a time; it starts
from the target's head and final norm, untied (Llama) or tied (Qwen2)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import EACH_ARCHITECTURE

from specserve.eagle.config import EagleConfig
from specserve.eagle.model import build_eagle, is_eagle_dir, load_eagle, save_eagle
from specserve.errors import InvalidArgument, NotFound
from specserve.glide.config import GlideConfig
from specserve.models import load_causal_lm
from specserve.models.tiny import Architecture, make_tiny_model, tiny_config
from specserve.runtime.kv_cache import PositionalKVCache


@pytest.fixture(scope="module")
def target(tmp_path_factory, architecture):
    directory = make_tiny_model(
        tmp_path_factory.mktemp("tiny"), architecture=architecture, vocab_size=96, num_heads=4, num_kv_heads=2
    )
    return load_causal_lm(directory)


@pytest.fixture(scope="module")
def draft(target):
    model = build_eagle(target, seed=3, draft_vocab_size=None)
    with torch.no_grad():  # a draft whose output differs visibly from its input features
        model.norm.weight.mul_(3.0)
    return model


@EACH_ARCHITECTURE
def test_config_follows_the_target(target) -> None:
    config = EagleConfig.from_target(target.config, draft_vocab_size=32)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads) == (64, 4, 2)
    assert config.rope_theta == target.config.rope_parameters["rope_theta"]  # 1e4 (Llama), 1e6 (Qwen2)
    assert config.head_vocab_size == 32
    with pytest.raises(InvalidArgument):
        EagleConfig.from_target(target.config, draft_vocab_size=97)
    with pytest.raises(InvalidArgument):
        EagleConfig.from_json('{"kind": "glide"}')


def test_a_target_with_scaled_rope_still_gets_a_draft() -> None:
    """The draft's attention reads its own keys only, so the target's RoPE scaling (Llama 3's here) does
    not bind it; GliDe, whose queries meet the target's keys, refuses such a target."""
    config = tiny_config(Architecture.LLAMA, vocab_size=96)
    config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert EagleConfig.from_target(config).rope_theta == 5e5
    with pytest.raises(InvalidArgument, match="default RoPE only"):
        GlideConfig.from_target(config)


@EACH_ARCHITECTURE
def test_head_and_norm_start_as_the_targets(target) -> None:
    draft = build_eagle(target, draft_vocab_size=16)
    ids = draft.draft_token_ids
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    logits = draft.logits(torch.randn(2, 64))
    assert logits.shape == (2, 96)
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
    hidden = torch.randn(3, 5, 64)
    assert torch.equal(draft.top_ids(hidden), draft.logits(hidden).argmax(-1))


@torch.no_grad()
def test_unrolled_steps_equal_drafting_token_by_token(draft) -> None:
    torch.manual_seed(0)
    seq, steps = 12, 4
    features = torch.randn(1, seq, 64)
    ids = torch.randint(0, 96, (1, seq))
    unrolled = draft.unrolled(features, ids, steps)
    assert torch.allclose(unrolled[0], draft(features, ids), atol=1e-5)
    for j in range(1, steps):
        for t in range(j, seq):
            root = t - j
            cache = PositionalKVCache(1, seq)
            y = draft(features[:, : root + 1], ids[:, : root + 1], cache=cache)[:, -1:]  # [1, 1, H]
            for s in range(1, j + 1):
                position = torch.tensor([root + s])
                y = draft(y, ids[:, root + s : root + s + 1], positions=position, cache=cache)
            assert torch.allclose(unrolled[j][:, t], y[:, 0], atol=1e-5), (j, t)
    # the feedback matters: step j differs from feeding the target's features again
    assert not torch.allclose(unrolled[1][:, 3:], unrolled[0][:, 3:], atol=1e-3)


def test_save_and_load_round_trip(tmp_path, target, draft) -> None:
    save_eagle(draft, tmp_path / "d")
    assert is_eagle_dir(tmp_path / "d") and not is_eagle_dir(tmp_path)
    loaded = load_eagle(tmp_path / "d", target)
    features, ids = torch.randn(1, 5, 64), torch.randint(0, 96, (1, 5))
    assert torch.equal(loaded(features, ids), draft(features, ids))
    assert not any(name.startswith("embed_tokens") for name in loaded.state_dict())  # borrowed, not stored
    with pytest.raises(NotFound):
        load_eagle(tmp_path / "missing", target)
