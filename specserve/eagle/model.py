"""A hidden-state draft in the manner of EAGLE (Li et al., 2024): one decoder layer over the target's
features.

Position t of the draft's sequence pairs the target's feature at t (its final hidden state after the last
norm: the vector its LM head turned into the token at t + 1) with the embedding of that token, x[t + 1]:

    x = fc([feature_t ; embed(x[t+1])])         2H -> H
    h = x + SelfAttn(RMSNorm_in(x))              causal, own KV cache, RoPE at position t, GQA
    h = h + SwiGLU(RMSNorm_post(h))
    y_t = RMSNorm_final(h)                       the predicted feature at t + 1
    logits = lm_head(y_t)                        scores x[t + 2]; reduced head, rows from the target's

Committed positions read the target's features; a drafted position reads the draft's own output at the
position before it (y_{t-1} in place of feature_t). A fused draft (`EagleConfig.feature_layers`) reads,
at committed positions, fuse([out_a(t); out_b(t); ...]) (k * H -> H, the outputs of k target decoder
layers) in place of the final hidden state: `lift` maps a target feature to what the layer reads.
Training unrolls that feedback (`unrolled`: the training-time test of EAGLE-3), so the draft learns
from the inputs it will see when drafting.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.sampling import make_generator
from specserve.eagle.config import EagleConfig
from specserve.errors import InvalidArgument, NotFound
from specserve.glide.model import (
    FrozenEmbedding,
    RMSNorm,
    SelfAttention,
    SwiGLU,
    _merge_heads,
    _split_heads,
    apply_rope,
    borrowed_embedding,
    init_draft_weights,
    register_draft_vocab,
    rope_cos_sin,
    save_draft,
    scatter_to_vocab,
    vocab_argmax,
)
from specserve.runtime.kv_cache import PositionalKVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class EagleDraft(nn.Module):
    draft_token_ids: torch.Tensor  # [V_draft] buffer: target id of each head row
    draft_index: torch.Tensor  # [V]: head row of each target id, -100 outside

    def __init__(
        self,
        config: EagleConfig,
        # the target's input embedding, [V, H] or its module (`borrowed_embedding`): borrowed, never stored
        target_embedding: torch.Tensor | nn.Module,
        draft_token_ids: torch.Tensor | None = None,  # [V_draft] full ids the reduced head scores
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = FrozenEmbedding(target_embedding)
        if self.embed_tokens.shape != (config.vocab_size, config.hidden_size):
            raise InvalidArgument("the hidden-state draft needs the target's [vocab, hidden] embedding")
        # only a fused draft has it: k target layers' outputs -> the width the draft reads
        self.fuse = (
            nn.Linear(config.feature_width, config.hidden_size, bias=False) if config.feature_layers else None
        )
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.head_vocab_size, bias=False)
        ids = torch.arange(config.head_vocab_size) if draft_token_ids is None else draft_token_ids
        register_draft_vocab(self, ids, config.head_vocab_size, config.vocab_size)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., feature_width] -> what the layer reads at a committed position,
        [..., H], on the draft's device and dtype: fused by `fuse`, or as they are."""
        reference = self.norm.weight  # not fc's: rounded (runtime/quantized_drafts.py) it has no tensor
        features = features.to(device=reference.device, dtype=reference.dtype)
        return features if self.fuse is None else self.fuse(features)

    def _inputs(self, features: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """features [B, S, H], input_ids [B, S] (the token after each feature) -> fc input [B, S, H]."""
        embedded = self.embed_tokens(input_ids).to(features.dtype)  # [B, S, H]
        return self.fc(torch.cat([features, embedded], dim=-1))

    def forward(
        self,
        features: torch.Tensor,  # [B, S, H] lifted target features (`lift`), or the draft's own outputs
        input_ids: torch.Tensor,  # [B, S] the token each feature chose
        positions: torch.Tensor | None = None,  # [S] absolute; None = 0 .. S-1
        cache: PositionalKVCache | None = None,  # the draft's own KV; None = no history (training)
    ) -> torch.Tensor:
        """-> predicted features y [B, S, H] (the next position's); `logits` turns them into scores."""
        seq = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device)  # [S]
        x = self._inputs(features, input_ids)  # [B, S, H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)  # [S, D]
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.norm(h)

    def unrolled(self, features: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Every position as a round's root, drafting `steps` tokens from it, all in `steps` passes.

        features [B, S, F] (the target's, feature_t at t, as stored: `lift` runs here), input_ids [B, S]
        (x[t + 1] at t) -> per step j the predicted features [B, S, H]. Step 0 is `forward`. At step
        j > 0 position t is the j-th drafted position of the round rooted at t - j: its feature is step
        j-1's output at t - 1, and it attends the target-fed keys of positions <= t - j plus its own
        round's keys, one per step s <= j (step s's key at t - j + s). Outputs at t < j have no root and
        are never scored.
        """
        features = self.lift(features)  # [B, S, H]
        _, seq, _ = features.shape
        positions = torch.arange(seq, device=features.device)
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, features.dtype)  # [S, D]
        attn = self.self_attn
        groups = cfg.num_heads // cfg.num_kv_heads
        scale = 1 / math.sqrt(cfg.head_dim)
        outputs: list[torch.Tensor] = []
        step_keys: list[torch.Tensor] = []  # step s >= 1: [B, Hq, S, D], kv heads repeated per query head
        step_values: list[torch.Tensor] = []
        base_k = base_v = torch.empty(0)
        step_features = features
        for j in range(steps):
            x = self._inputs(step_features, input_ids)  # [B, S, H]
            normed = self.input_layernorm(x)
            q = apply_rope(_split_heads(attn.q_proj(normed), cfg.num_heads), cos, sin)  # [B, Hq, S, D]
            k = apply_rope(_split_heads(attn.k_proj(normed), cfg.num_kv_heads), cos, sin)  # [B, Hkv, S, D]
            v = _split_heads(attn.v_proj(normed), cfg.num_kv_heads)
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [B, Hq, S, D]
            if j == 0:
                base_k, base_v = k, v
            else:
                step_keys.append(k)
                step_values.append(v)
            # target-fed keys: column c visible from row t when c <= t - j
            visible = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril(-j)  # [S, S]
            scores = (q @ base_k.transpose(-1, -2)).float() * scale  # [B, Hq, S, S]
            scores = scores.masked_fill(~visible, float("-inf"))
            # this round's keys: step s's at t - (j - s), s = 1..j
            own_k = [_shift(step_keys[s - 1], j - s) for s in range(1, j + 1)]  # each [B, Hq, S, D]
            own_v = [_shift(step_values[s - 1], j - s) for s in range(1, j + 1)]
            own = [((q * key).sum(-1, keepdim=True)).float() * scale for key in own_k]  # [B, Hq, S, 1]
            probs = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)  # [B, Hq, S, S + j]
            probs = torch.nan_to_num(probs)  # a row with no visible key at all (t < j, unscored)
            out = probs[..., :seq].to(v.dtype) @ base_v  # [B, Hq, S, D]
            for s, value in enumerate(own_v):
                out = out + probs[..., seq + s : seq + s + 1].to(v.dtype) * value
            h = x + attn.o_proj(_merge_heads(out))
            h = h + self.mlp(self.post_attention_layernorm(h))
            y = self.norm(h)  # [B, S, H]
            outputs.append(y)
            step_features = _shift(y.unsqueeze(1), 1).squeeze(1)  # position t reads step j's output at t-1
        return outputs

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_draft]."""
        return self.lm_head(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] over the target's vocabulary; tokens outside the reduced head get -inf, so
        no rule ever picks them and the target's verification stays exact."""
        scores = self.draft_logits(hidden)  # [..., V_draft]
        if self.config.draft_vocab_size is None:
            return scores
        return scatter_to_vocab(scores, self.draft_token_ids, self.config.vocab_size)

    def top_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] the target-vocabulary id of the highest score: `logits(hidden).argmax(-1)`
        without the [..., V] scores."""
        reduced = self.config.draft_vocab_size is not None
        return vocab_argmax(self.draft_logits(hidden), self.draft_token_ids if reduced else None)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        init_draft_weights(self, generator, std)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, S, D] -> the same with position t holding x[..., t - n, :] (zeros for t < n)."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, n, 0))[..., : x.shape[-2], :]


# --- building, saving and loading ---------------------------------------------------------------


def build_eagle(
    target_model: nn.Module,
    seed: int = 0,
    draft_token_ids: torch.Tensor | None = None,
    **overrides: object,
) -> EagleDraft:
    """A draft fitted to `target_model` (a HF causal LM): the layer random, the head and the final norm
    the target's own rows and weights (a draft that starts by reading the target's LM head)."""
    target = cast("PreTrainedModel", target_model)
    config = EagleConfig.from_target(target.config, **overrides)
    model = _new_draft(config, target, draft_token_ids)
    model.init_weights(make_generator(seed))  # on the CPU: the same draft whatever the target's device
    model = _for_inference(model, target)  # then the target's rows are copied where they already are
    with torch.no_grad():
        head_weight = cast(torch.Tensor, target.get_output_embeddings().weight)  # [V, H]
        model.lm_head.weight.copy_(head_weight[model.draft_token_ids])
        final_norm = cast(nn.Module, cast(nn.Module, target.model).norm)
        model.norm.weight.copy_(cast(torch.Tensor, final_norm.weight))
    return model


def save_eagle(model: EagleDraft, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors (never pickle); the borrowed target embedding is not stored."""
    return save_draft(model, model.config, directory, dtype)


def is_eagle_dir(directory: Path) -> bool:
    """Whether `directory` holds a hidden-state draft (rather than a GliDe one)."""
    import json

    path = Path(directory).expanduser() / CONFIG_FILE
    return path.is_file() and json.loads(path.read_text()).get("kind") == "eagle"


def load_eagle(directory: Path, target_model: nn.Module) -> EagleDraft:
    """Loads a draft saved by `save_eagle` for `target_model`, on its device and dtype."""
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise NotFound(f"{directory} holds no hidden-state draft ({CONFIG_FILE} + {WEIGHTS_FILE})")
    target = cast("PreTrainedModel", target_model)
    config = EagleConfig.load(directory / CONFIG_FILE)
    config.check_target(target.config)
    state = load_file(str(directory / WEIGHTS_FILE))
    model = _new_draft(config, target, state.get("draft_token_ids"))
    model.load_state_dict(state, strict=True)
    return _for_inference(model, target)


def _new_draft(
    config: EagleConfig, target: PreTrainedModel, draft_token_ids: torch.Tensor | None
) -> EagleDraft:
    return EagleDraft(config, borrowed_embedding(target), draft_token_ids)


def _for_inference(model: EagleDraft, target: nn.Module) -> EagleDraft:
    reference = next(target.parameters())
    model.to(device=reference.device, dtype=reference.dtype)
    return model.eval().requires_grad_(False)
