"""What drafts borrow of the target, read straight from its checkpoint: its config, input embedding, LM head
and final norm, and no decoder layer.

A GliDe or hidden-state draft embeds tokens with the target's embedding, and a hidden-state draft built
from scratch starts from the target's head and norm. A draft replica reads just these tensors from the
target's safetensors (one file or an indexed set of shards), so it holds no target layer. `TargetShare`
answers the same calls as a transformers causal LM for these parts (`config`, `get_input_embeddings`,
`get_output_embeddings`, `model.norm`), so the draft loaders take either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.errors import FailedPrecondition

EMBEDDING_KEY = "model.embed_tokens.weight"  # [V, H]
HEAD_KEY = "lm_head.weight"  # [V, H]; absent when tied to the embedding
NORM_KEY = "model.norm.weight"  # [H]
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class _Norm(nn.Module):
    """The final norm's weight (what a new hidden-state draft copies); it is never run here."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class _Inner(nn.Module):
    def __init__(self, embedding: torch.Tensor, norm: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.norm = _Norm(norm)


class TargetShare(nn.Module):
    def __init__(
        self, config: object, embedding: torch.Tensor, head: torch.Tensor | None, norm: torch.Tensor
    ):
        super().__init__()
        self.config = config
        self.model = _Inner(embedding, norm)
        self.lm_head = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False)
        # A tied head is the embedding itself: one copy in memory, as in the target.
        self.lm_head.weight = self.model.embed_tokens.weight if head is None else nn.Parameter(head, False)
        self.eval().requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def read_target_share(model_dir: Path, device: str, dtype: torch.dtype) -> TargetShare:
    """The shared tensors of the checkpoint in `model_dir`, on `device` in `dtype`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    keys = [EMBEDDING_KEY, NORM_KEY] + ([] if tied else [HEAD_KEY])
    tensors = {
        key: t.to(device=device, dtype=dtype) for key, t in read_tensors(Path(model_dir), keys).items()
    }
    head = None if tied else tensors[HEAD_KEY]
    return TargetShare(config, tensors[EMBEDDING_KEY], head, tensors[NORM_KEY])


def read_tensors(model_dir: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Just `keys` of a safetensors checkpoint: each read from the file that holds it, nothing else mapped
    into memory for long."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (model_dir / WEIGHTS_FILE).is_file():
        weight_map = dict.fromkeys(keys, WEIGHTS_FILE)
    else:
        raise FailedPrecondition(f"{model_dir} holds no {WEIGHTS_FILE} nor {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        if key not in weight_map:
            raise FailedPrecondition(f"{model_dir}'s checkpoint has no {key}")
        with safe_open(str(model_dir / weight_map[key]), framework="pt") as weights:
            if key not in weights.keys():  # noqa: SIM118  # safe_open has keys(), not __contains__
                raise FailedPrecondition(f"{model_dir}'s checkpoint has no {key}")
            tensors[key] = weights.get_tensor(key).clone()  # owned, not a view of the mapped file
    return tensors
