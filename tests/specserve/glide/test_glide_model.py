"""The GliDe draft model: forward against a plain reference, masks, reduced vocab, checkpoints, training;
fitted to a Llama or a Qwen2 target, it rotates its queries exactly as the target rotated its keys."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_llama import EACH_ARCHITECTURE, tiny_llama, tiny_model, tiny_qwen2

from specserve.core.sampling import logits_to_probs
from specserve.core.sampling_params import SamplingParams
from specserve.errors import InvalidArgument
from specserve.glide import (
    GlideConfig,
    GlideDraft,
    blockwise_cross_mask,
    build_glide,
    frequency_ranked_ids,
    load_glide,
    save_glide,
)
from specserve.glide.config import spread_target_layers
from specserve.glide.model import (
    cross_mask_from_lengths,
    rope_cos_sin,
    scatter_to_vocab,
    trained_cross_lengths,
    vocab_argmax,
)
from specserve.runtime.kv_cache import PositionalKVCache

# Target geometry differs from the draft's so that a mix-up of the two cannot pass.
CONFIG = GlideConfig(
    vocab_size=50,
    hidden_size=24,
    intermediate_size=40,
    num_heads=4,  # draft head_dim 6
    num_kv_heads=2,
    target_num_heads=6,
    target_num_kv_heads=3,
    target_head_dim=10,
    rope_theta=500.0,
)


def _model(config: GlideConfig = CONFIG, seed: int = 0, **kwargs) -> GlideDraft:
    model = GlideDraft(config, **kwargs)
    model.init_weights(torch.Generator().manual_seed(seed), std=0.3)  # large: a sharp test of every term
    return model.eval()


def _target_kv(batch: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, CONFIG.target_num_kv_heads, length, CONFIG.target_head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# --- a plain reference: loops over batch and heads, float64 --------------------------------------


def _rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x: [D] rotated by Llama's half-split RoPE at `position`: pairs (i, i + D/2)."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = position * theta ** (-2 * i / x.shape[0])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps)


def _heads_attention(q, keys, values, mask, num_heads, num_kv_heads, positions, rotate_keys):
    """q: [S, Hq*D] projected queries; keys/values: [Hkv, L, D]; mask: [S, L] -> [S, Hq*D]."""
    seq, head_dim = q.shape[0], keys.shape[-1]
    out = torch.zeros(seq, num_heads * head_dim, dtype=q.dtype)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)  # GQA: repeat each kv head for its group of query heads
        for t in range(seq):
            qt = _rope(q[t, h * head_dim : (h + 1) * head_dim], int(positions[t]), CONFIG.rope_theta)
            ks = keys[kv]
            if rotate_keys:
                ks = torch.stack([_rope(ks[s], s, CONFIG.rope_theta) for s in range(ks.shape[0])])
            scores = torch.einsum("d,ld->l", qt, ks) / math.sqrt(head_dim)
            scores = scores.masked_fill(~mask[t], float("-inf"))
            out[t, h * head_dim : (h + 1) * head_dim] = torch.softmax(scores, -1) @ values[kv]
    return out


def _reference(model: GlideDraft, input_ids, target_kv, cross_mask) -> torch.Tensor:
    """Final-normed hidden states [B, S, H], positions 0 .. S-1, computed the obvious way."""
    w = {k: v.double() for k, v in model.state_dict().items()}
    c = model.config
    seq = input_ids.shape[1]
    positions = torch.arange(seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    outs = []
    for b in range(input_ids.shape[0]):
        x = w["embed_tokens.weight"][input_ids[b]]  # [S, H]
        n = _rms(x, w["layers.0.input_layernorm.weight"])
        k = (n @ w["layers.0.self_attn.k_proj.weight"].T).view(seq, c.num_kv_heads, -1).transpose(0, 1)
        v = (n @ w["layers.0.self_attn.v_proj.weight"].T).view(seq, c.num_kv_heads, -1).transpose(0, 1)
        q = n @ w["layers.0.self_attn.q_proj.weight"].T
        attn = _heads_attention(q, k, v, causal, c.num_heads, c.num_kv_heads, positions, rotate_keys=True)
        h = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
        q = h @ w["layers.0.cross_attn.q_proj.weight"].T  # no norm before cross-attention
        tk, tv = target_kv[0][b].double(), target_kv[1][b].double()  # keys used as they are
        cross = _heads_attention(
            q, tk, tv, cross_mask, c.target_num_heads, c.target_num_kv_heads, positions, rotate_keys=False
        )
        h = h + cross @ w["layers.0.cross_attn.o_proj.weight"].T
        n = _rms(h, w["layers.0.post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(n @ w["layers.0.mlp.gate_proj.weight"].T)
        h = h + (gate * (n @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
        outs.append(_rms(h, w["norm.weight"]))
    return torch.stack(outs).float()


def test_forward_matches_reference_with_blockwise_mask():
    model = _model()
    input_ids = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    target_kv = _target_kv(batch=2, length=11)
    mask = blockwise_cross_mask(11, block_size=3)
    hidden = model(input_ids, target_kv, mask)
    assert hidden.shape == (2, 11, CONFIG.hidden_size)
    assert model.logits(hidden).shape == (2, 11, CONFIG.vocab_size)
    torch.testing.assert_close(hidden, _reference(model, input_ids, target_kv, mask), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_incremental_forward_with_the_draft_cache_matches_one_pass(num_layers):
    model = _model(dataclasses.replace(CONFIG, num_layers=num_layers))
    input_ids = torch.randint(0, CONFIG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    target_kv = _target_kv(batch=1, length=6)
    mask = cross_mask_from_lengths(torch.tensor([1, 2, 3, 3, 3, 6, 6, 6, 6]), 6)  # [9, 6]
    whole = model(input_ids, target_kv, mask)  # [1, 9, H]
    cache = PositionalKVCache(num_layers=num_layers, capacity=16)  # each block keeps its own K/V
    pieces = [
        model(input_ids[:, a:b], target_kv, mask[a:b], torch.arange(a, b), cache)
        for a, b in [(0, 4), (4, 5), (5, 9)]
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.length == 9


def test_blockwise_cross_mask_by_hand():
    rows = ["10000", "11000", "11000", "11000", "11110"]  # block 2: first block causal, then < 2 * b
    expected = torch.tensor([[c == "1" for c in row] for row in rows])
    assert torch.equal(blockwise_cross_mask(5, block_size=2), expected)
    mask = blockwise_cross_mask(12, block_size=5)
    assert mask[:5].equal(torch.ones(5, 12, dtype=torch.bool).tril())
    assert mask[5:10].sum(-1).tolist() == [5] * 5 and mask[10:].sum(-1).tolist() == [10] * 2


def test_blockwise_mask_covers_the_inference_lags():
    """At inference the root at L and its draft tokens L+1 .. L+gamma-1 all see target positions < L:
    lags (query position - visible keys) 0 .. gamma-1. Blocks of gamma + 1 train every one of them."""
    gamma = 4
    positions = torch.arange(gamma + 1, 200)
    lags = positions - trained_cross_lengths(positions, block_size=gamma + 1)
    assert set(lags.tolist()) == set(range(gamma + 1))


def test_reduced_vocabulary_maps_back_to_full_ids():
    counts = torch.zeros(CONFIG.vocab_size)
    counts[[7, 3, 42, 19, 0, 11]] = torch.tensor([9.0, 8, 7, 6, 5, 4])
    ids = frequency_ranked_ids(counts, 6)
    assert ids.tolist() == [7, 3, 42, 19, 0, 11]
    config = GlideConfig(**{**CONFIG.__dict__, "draft_vocab_size": 6})
    model = _model(config, draft_token_ids=ids)
    hidden = model(torch.tensor([[1, 2, 3]]), _target_kv(1, 3), blockwise_cross_mask(3))  # [1, 3, H]
    small, full = model.draft_logits(hidden), model.logits(hidden)  # [1, 3, 6], [1, 3, V]
    assert small.shape[-1] == 6 and full.shape[-1] == CONFIG.vocab_size
    torch.testing.assert_close(full[..., ids], small)
    outside = torch.ones(CONFIG.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(full[..., outside]).all()
    assert set(full.argmax(-1).flatten().tolist()) <= set(ids.tolist())
    assert torch.equal(model.top_ids(hidden), full.argmax(-1))
    probs = logits_to_probs(full[0, -1], SamplingParams(temperature=1.0))
    assert probs[outside].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    # The loss scores labels inside the head and ignores the rest.
    loss = model.loss(hidden, torch.tensor([[42, 5, -100]]))  # 5 is outside: only 42 counts
    expected = torch.nn.functional.cross_entropy(small[0, :1], torch.tensor([2]))
    torch.testing.assert_close(loss, expected)


def test_the_top_id_in_the_heads_rows_is_the_full_scores_argmax_ties_included():
    """Scores of few distinct values tie often; the head's rows are in frequency order, not id order,
    and the full scores' argmax takes the lowest id among the tied."""
    ids = torch.tensor([7, 3, 42, 19, 0, 11])
    scores = torch.randint(0, 3, (500, 6), generator=torch.Generator().manual_seed(0)).float()  # [N, V_draft]
    full = scatter_to_vocab(scores, ids, CONFIG.vocab_size)  # [N, V]
    assert torch.equal(vocab_argmax(scores, ids), full.argmax(-1))
    assert (scores == scores.amax(-1, keepdim=True)).sum(-1).max() > 1  # ties were there


def test_config_json_round_trip_and_from_target():
    assert GlideConfig.from_json(CONFIG.to_json()) == CONFIG
    target = tiny_llama()
    config = GlideConfig.from_target(target.config, intermediate_size=16, draft_vocab_size=8)
    assert (config.hidden_size, config.target_num_heads, config.target_num_kv_heads) == (32, 4, 2)
    assert (config.target_head_dim, config.intermediate_size, config.draft_vocab_size) == (8, 16, 8)
    assert config.rope_theta == target.config.rope_parameters["rope_theta"]
    config.check_target(target.config)
    with pytest.raises(InvalidArgument):
        GlideConfig.from_json('{"vocab_size": 3, "colour": "blue"}')
    with pytest.raises(InvalidArgument):
        GlideConfig.from_target(target.config, num_kv_heads=3)


def test_from_target_reads_the_targets_head_dim_and_rope_theta():
    """Qwen2's heads are wider than hidden / heads (16 with hidden 32 and 4 heads), its theta 1e6."""
    target = tiny_qwen2()
    config = GlideConfig.from_target(target.config)
    assert (config.target_head_dim, config.head_dim, config.rope_theta) == (16, 8, 1e6)
    config.check_target(target.config)
    with pytest.raises(InvalidArgument):  # cached keys of another shape and theta
        config.check_target(tiny_llama().config)


@EACH_ARCHITECTURE
def test_the_draft_query_turns_as_the_target_turned_its_keys(architecture):
    """Cross-attention scores a rotated query against keys the target rotated: the same frequencies."""
    target = tiny_model(architecture)
    config = GlideConfig.from_target(target.config)
    positions = torch.arange(0, 4000, 37)  # [S]
    cos, sin = rope_cos_sin(positions, config.target_head_dim, config.rope_theta, torch.float32)  # [S, Dt]
    with torch.no_grad():
        target_cos, target_sin = target.model.rotary_emb(torch.zeros(1, 1), positions[None])  # [1, S, Dt]
    torch.testing.assert_close(cos, target_cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, target_sin[0], atol=1e-5, rtol=0)


def _assert_same_forward(a: GlideDraft, b: GlideDraft) -> None:
    input_ids = torch.tensor([[5, 9, 2, 31]])
    target_kv = (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    mask = blockwise_cross_mask(4)
    expected = a.logits(a(input_ids, target_kv, mask))  # [1, 4, V]
    torch.testing.assert_close(b.logits(b(input_ids, target_kv, mask)), expected)


def test_checkpoint_round_trip_own_embedding_and_reduced_head(tmp_path):
    target = tiny_llama()
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:12]
    model = build_glide(target, seed=5, draft_vocab_size=12, draft_token_ids=ids)
    save_glide(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_glide(tmp_path, target)
    assert loaded.config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded.draft_token_ids, ids)
    _assert_same_forward(model, loaded)


def test_a_second_block_changes_the_output_and_round_trips(tmp_path):
    target = tiny_llama()
    one = build_glide(target, seed=5)
    two = build_glide(target, seed=5, num_layers=2)
    assert len(two.layers) == 2 and two.config.num_layers == 2
    input_ids = torch.tensor([[3, 1, 4, 1]])
    target_kv = (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    mask = blockwise_cross_mask(4)
    assert not torch.allclose(one(input_ids, target_kv, mask), two(input_ids, target_kv, mask))
    save_glide(two, tmp_path)
    _assert_same_forward(two, load_glide(tmp_path, target))


def test_blocks_reading_their_own_target_layers_round_trip(tmp_path):
    target = tiny_llama()
    model = build_glide(target, seed=5, num_layers=2, block_target_layers=(0, -1))
    assert model.config.layers_read == (0, -1) and model.config.feed_layers == [-1, 0]
    input_ids = torch.tensor([[3, 1, 4, 1]])
    a, b = (
        (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)),
        (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)),
    )
    mask = blockwise_cross_mask(4)
    assert torch.equal(model(input_ids, [a, a], mask), model(input_ids, a, mask))  # one layer = every block
    assert not torch.allclose(model(input_ids, [a, b], mask), model(input_ids, [b, a], mask))
    with pytest.raises(InvalidArgument):
        model(input_ids, [a, b, a], mask)  # three layers for two blocks
    save_glide(model, tmp_path)
    loaded = load_glide(tmp_path, target)
    assert loaded.config == model.config  # the JSON list comes back as the same tuple
    torch.testing.assert_close(loaded(input_ids, [a, b], mask), model(input_ids, [a, b], mask))
    with pytest.raises(InvalidArgument):
        dataclasses.replace(CONFIG, num_layers=2, block_target_layers=(0,))
    with pytest.raises(InvalidArgument):
        dataclasses.replace(model.config, block_target_layers=(0, 2)).check_target(target.config)


def test_blocks_spread_through_the_targets_depth_ending_at_its_last_layer():
    assert spread_target_layers(1, 30) == (29,)
    assert spread_target_layers(2, 30) == (14, 29)  # what docs/training.md measured
    assert spread_target_layers(3, 30) == (9, 19, 29)
    assert spread_target_layers(2, 2) == (0, 1)
    assert spread_target_layers(3, 1) == (0, 0, 0)  # more blocks than layers: they share
    with pytest.raises(InvalidArgument):
        spread_target_layers(0, 30)


def test_a_file_naming_its_one_block_layer_still_loads(tmp_path):
    """Drafts saved when the block was a single `layer` attribute load as `layers.0`."""
    from safetensors.torch import load_file, save_file

    target = tiny_llama()
    model = build_glide(target, seed=5)
    save_glide(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    old = {name.replace("layers.0.", "layer.", 1): tensor for name, tensor in state.items()}
    assert any(name.startswith("layer.") for name in old)
    save_file(old, str(tmp_path / "model.safetensors"))
    _assert_same_forward(model, load_glide(tmp_path, target))


def test_checkpoint_with_shared_embedding_does_not_store_it(tmp_path):
    from safetensors import safe_open

    target = tiny_llama()
    model = build_glide(target, seed=5, share_target_embeddings=True)
    target_weight = target.get_input_embeddings().weight
    assert model.embed_tokens.weight.data_ptr() == target_weight.data_ptr()  # borrowed, not copied
    save_glide(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any("embed" in name for name in f.keys())  # noqa: SIM118 (safe_open is no dict)
    with pytest.raises(InvalidArgument):
        load_glide(tmp_path)
    loaded = load_glide(tmp_path, target)
    assert loaded.embed_tokens.weight.data_ptr() == target_weight.data_ptr()
    _assert_same_forward(model, loaded)


def test_training_with_the_blockwise_mask_lowers_the_loss():
    """A few AdamW steps on text sampled from a tiny target, with the target's KV as the glimpse."""
    target = tiny_llama(seed=0)
    torch.manual_seed(0)
    prompts = torch.randint(0, 64, (8, 2))
    with torch.no_grad():
        text = target.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=22, do_sample=True, top_k=0
        )  # [8, 24]
        cache = PositionalKVCache(target.config.num_hidden_layers, capacity=text.shape[1])
        target(text[:, :-1], past_key_values=cache, use_cache=True)
    target_kv = cache.layer_kv(-1)  # [8, Hkv, 23, D]
    inputs, labels = text[:, :-1], text[:, 1:]
    mask = blockwise_cross_mask(inputs.shape[1], block_size=5)
    draft = build_glide(target, seed=0, share_target_embeddings=True).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(25):
        loss = draft.loss(draft(inputs, target_kv, mask), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert not draft.embed_tokens.weight.requires_grad  # the shared embedding stays frozen
    assert losses[-1] < losses[0] - 0.5, losses
