"""EagleConfig: the whole configuration of a hidden-state draft, saved as config.json beside its weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from specserve.errors import InvalidArgument
from specserve.glide.config import rope_base

DEFAULT_DRAFT_VOCAB = 8192  # rows of the reduced head unless told otherwise (the GliDe draft's, too)
KIND = "eagle"  # written into config.json: tells a hidden-state draft's directory from a GliDe one's


def fused_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The decoder layers (from 0) whose outputs a fused draft reads by default: a low, a middle and a
    high one (EAGLE-3's choice as vLLM makes it: 2, L // 2, L - 3), fewer on a very shallow target."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


@dataclass(frozen=True)
class EagleConfig:
    """One Llama-style decoder layer over fc([target feature, next token's embedding]).

    The feature is, without `feature_layers`, the target's final hidden state after its last norm, the
    vector its LM head reads (specserve/runtime: `PositionalKVCache.features`); the draft's output lives
    in the same space, so a drafted position feeds its own output back as the next position's feature.
    With `feature_layers` (EAGLE-3's fused input), it is the outputs of those target decoder layers side
    by side, [k * H], which a linear `fuse` maps to H before the draft reads it; drafted positions read
    the draft's own output as before. Self-attention has its own geometry; the draft is as wide as the
    target (the feature and the embedding are target-sized).
    """

    vocab_size: int  # the target's vocabulary: logits are always reported over it
    hidden_size: int  # the target's: features and embeddings are this wide
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Reduced LM head: the draft scores only its `draft_vocab_size` most frequent tokens (the id map is
    # saved with the weights as `draft_token_ids`); None = the full vocabulary.
    draft_vocab_size: int | None = None
    # Target decoder layers (from 0) whose outputs form the fused feature; () = the final normed state.
    feature_layers: tuple[int, ...] = ()
    kind: str = KIND

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # JSON gives a list
        layers = self.feature_layers
        if any(not isinstance(layer, int) or layer < 0 for layer in layers) or list(layers) != sorted(
            set(layers)
        ):
            raise InvalidArgument(f"feature_layers must be distinct layer numbers >= 0, ascending: {layers}")
        if min(self.vocab_size, self.hidden_size, self.intermediate_size) < 1:
            raise InvalidArgument(f"sizes must be positive: {self}")
        if min(self.num_heads, self.num_kv_heads) < 1 or self.hidden_size % self.num_heads:
            raise InvalidArgument("hidden_size must divide by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument("num_heads must divide by num_kv_heads")
        if self.head_dim % 2:
            raise InvalidArgument("RoPE needs an even head dimension")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise InvalidArgument(f"draft_vocab_size must be in [1, {self.vocab_size}]")
        if self.kind != KIND:
            raise InvalidArgument(f"not a hidden-state draft config (kind {self.kind!r})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_width(self) -> int:
        """Width of the target's feature at a committed position: H, or k * H fused."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @property
    def head_vocab_size(self) -> int:
        """Rows of the LM head: the reduced vocabulary when there is one."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target_config: Any, **overrides: Any) -> EagleConfig:
        """A draft layer shaped like one of the target's (`target_config`: a Hugging Face decoder config)."""
        num_heads = target_config.num_attention_heads
        base = cls(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", None) or num_heads,
            # its own keys only: the target's theta as a start, any scaling of the target's left out
            rope_theta=rope_base(target_config),
            rms_norm_eps=target_config.rms_norm_eps,
        )
        overrides.setdefault("draft_vocab_size", min(DEFAULT_DRAFT_VOCAB, target_config.vocab_size))
        return replace(base, **overrides)

    def check_target(self, target_config: Any) -> None:
        """Raises InvalidArgument unless the target's features and vocabulary are the ones trained on."""
        for name, theirs in (
            ("vocab_size", target_config.vocab_size),
            ("hidden_size", target_config.hidden_size),
        ):
            if getattr(self, name) != theirs:
                raise InvalidArgument(
                    f"the hidden-state draft does not fit the target: {name} "
                    f"{getattr(self, name)} != {theirs}"
                )
        if self.feature_layers and self.feature_layers[-1] >= target_config.num_hidden_layers:
            raise InvalidArgument(
                f"the hidden-state draft reads target layers {list(self.feature_layers)}; the target has "
                f"{target_config.num_hidden_layers}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EagleConfig:
        values = json.loads(text)
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgument(f"unknown hidden-state draft config fields: {', '.join(sorted(unknown))}")
        if values.get("kind") != KIND:
            raise InvalidArgument(f"not a hidden-state draft config (kind {values.get('kind')!r})")
        try:
            return cls(**values)
        except TypeError as e:  # a missing field
            raise InvalidArgument(f"incomplete hidden-state draft config: {e}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> EagleConfig:
        return cls.from_json(Path(path).read_text())
