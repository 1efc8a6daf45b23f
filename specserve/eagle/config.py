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


@dataclass(frozen=True)
class EagleConfig:
    """One Llama-style decoder layer over fc([target feature, next token's embedding]).

    The feature is the target's final hidden state after its last norm, the vector its LM head reads
    (specserve/runtime: `PositionalKVCache.features`); the draft's output lives in the same space, so a
    drafted position feeds its own output back as the next position's feature. Self-attention has its
    own geometry; the draft is as wide as the target (the feature and the embedding are target-sized).
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
    kind: str = KIND

    def __post_init__(self) -> None:
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
