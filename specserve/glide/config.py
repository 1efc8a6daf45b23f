"""GlideConfig: the whole configuration of a GliDe draft, saved as config.json next to its weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from specserve.errors import InvalidArgument


@dataclass(frozen=True)
class GlideConfig:
    """Llama-style blocks (one by default) that cross-attend to one layer of the target's KV cache.

    Draft self-attention has its own geometry (num_heads, num_kv_heads, head_dim = hidden / heads);
    cross-attention uses the target's (target_num_heads, target_num_kv_heads, target_head_dim) because
    its keys and values are the target's cached ones.
    """

    vocab_size: int  # the target's vocabulary: logits are always reported over it
    hidden_size: int
    intermediate_size: int
    num_heads: int  # draft self-attention
    num_kv_heads: int
    target_num_heads: int
    target_num_kv_heads: int
    target_head_dim: int
    target_layer: int = -1  # which target layer's KV is read; -1 = the last (best in the paper)
    rope_theta: float = 10000.0  # the target's: cached keys were rotated with it
    rms_norm_eps: float = 1e-5
    # Reduced LM head: the draft scores only its `draft_vocab_size` most frequent tokens (the id map is
    # saved with the weights as `draft_token_ids`); None = the full vocabulary.
    draft_vocab_size: int | None = None
    # True: embed with the target's frozen input embedding (not stored in draft checkpoints).
    share_target_embeddings: bool = False
    # Training's block-wise cross-attention mask; inference re-encodes committed tokens with the same
    # mask so the draft's cached states are exactly the ones it was trained on.
    block_size: int = 5
    # False = the same block without cross-attention: a plain one-layer draft of equal size and cost
    # otherwise, trained on the same data (the ablation that shows what reading the target's KV buys).
    cross_attention: bool = True
    # Blocks stacked (each with self-attention, cross-attention to a target layer, and MLP); the paper's
    # draft is one.
    num_layers: int = 1
    # The target layer each block reads, one per block; empty = every block reads `target_layer`.
    # Giving lower blocks a middle layer hands the draft more of the target on the same KV feed.
    block_target_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (
            min(self.vocab_size, self.hidden_size, self.intermediate_size, self.block_size, self.num_layers)
            < 1
        ):
            raise InvalidArgument(f"sizes must be positive: {self}")
        if min(self.num_heads, self.num_kv_heads) < 1 or self.hidden_size % self.num_heads:
            raise InvalidArgument("hidden_size must divide by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument("num_heads must divide by num_kv_heads")
        if self.head_dim % 2 or self.target_head_dim % 2:
            raise InvalidArgument("RoPE needs even head dimensions")
        if self.target_num_kv_heads < 1 or self.target_num_heads % self.target_num_kv_heads:
            raise InvalidArgument("target_num_heads must divide by target_num_kv_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise InvalidArgument(f"draft_vocab_size must be in [1, {self.vocab_size}]")
        if self.block_target_layers and len(self.block_target_layers) != self.num_layers:
            raise InvalidArgument(
                f"block_target_layers names {len(self.block_target_layers)} layers "
                f"for {self.num_layers} blocks"
            )
        object.__setattr__(self, "block_target_layers", tuple(self.block_target_layers))  # JSON gives a list

    @property
    def layers_read(self) -> tuple[int, ...]:
        """The target layer of each block (as configured: -1 is the last)."""
        return self.block_target_layers or (self.target_layer,) * self.num_layers

    @property
    def feed_layers(self) -> list[int]:
        """The distinct target layers this draft reads: what its KV feed must carry."""
        return sorted(set(self.layers_read))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def head_vocab_size(self) -> int:
        """Rows of the LM head: the reduced vocabulary when there is one."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target_config: Any, **overrides: Any) -> GlideConfig:
        """A draft as wide as the target (the paper's choice), reading its last layer.

        `target_config` is a Hugging Face Llama-style config; `overrides` replace any field.
        """
        rope_theta = target_rope_theta(target_config)
        num_heads = target_config.num_attention_heads
        num_kv_heads = getattr(target_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // num_heads
        base = cls(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            target_num_heads=num_heads,
            target_num_kv_heads=num_kv_heads,
            target_head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=target_config.rms_norm_eps,
        )
        return replace(base, **overrides)

    def check_target(self, target_config: Any) -> None:
        """Raises InvalidArgument unless the target's cache has the shape this draft reads."""
        other = GlideConfig.from_target(target_config)
        wanted = ("vocab_size", "target_num_heads", "target_num_kv_heads", "target_head_dim", "rope_theta")
        for name in wanted:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise InvalidArgument(f"the GliDe draft does not fit the target: {name} {mine} != {theirs}")
        num_layers = target_config.num_hidden_layers
        for layer in (self.target_layer, *self.layers_read):
            if not -num_layers <= layer < num_layers:
                raise InvalidArgument(f"target layer {layer} is not a layer of the target")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GlideConfig:
        values = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise InvalidArgument(f"unknown GliDe config fields: {', '.join(sorted(unknown))}")
        return cls(**values)

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> GlideConfig:
        return cls.from_json(Path(path).read_text())


def spread_target_layers(num_blocks: int, num_target_layers: int) -> tuple[int, ...]:
    """The target layer each of `num_blocks` draft blocks reads, spread evenly through the target's depth
    and ending at its last layer: 1 block of 30 layers reads (29,), 2 read (14, 29), 3 read (9, 19, 29).
    Measured (docs/training.md): two blocks reading (14, 29) beat two reading (29, 29)."""
    if num_blocks < 1 or num_target_layers < 1:
        raise InvalidArgument("a draft needs a block and a target with a layer")
    return tuple(max(0, round((i + 1) * num_target_layers / num_blocks) - 1) for i in range(num_blocks))


def rope_base(target_config: Any) -> float:
    """The target's RoPE theta (10000 for Llama, 1e6 for Qwen2.5), whatever scaling it applies on top.

    transformers >= 5 keeps RoPE settings in `rope_parameters`; older configs in `rope_theta`."""
    params = getattr(target_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)))


def target_rope_theta(target_config: Any) -> float:
    """The theta of a target whose cached keys GliDe can match: its RoPE must be the default one."""
    params = getattr(target_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        # Scaled RoPE variants change the frequencies; the draft query must match the cached keys.
        raise InvalidArgument(f"GliDe supports default RoPE only, the target uses {rope_type!r}")
    return rope_base(target_config)
