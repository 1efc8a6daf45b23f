"""What drafts borrow of the target, read straight from its checkpoint: its config, input embedding, LM head
and final norm, and no decoder layer.

A GliDe or hidden-state draft embeds tokens with the target's embedding, and a hidden-state draft built
from scratch starts from the target's head and norm. A draft replica reads just these tensors from the
target's safetensors (one file or an indexed set of shards), so it holds no target layer. Where the target
runs its file's own weights, the embedding is read from the same quantized store and kept in the file's
codes (`Int4Embedding`: 31 MB for the default model's Q8_0 table, where float32 takes 113 MB), as the
target keeps it; looked-up rows decode to the same values. `TargetShare` answers the same calls as a
transformers causal LM for these parts (`config`, `get_input_embeddings`, `get_output_embeddings`,
`model.norm`), so the draft loaders take either; a tied head is built only when asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

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
    def __init__(self, embedding: nn.Module, norm: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = embedding
        self.norm = _Norm(norm)


class TargetShare(nn.Module):
    def __init__(
        self,
        config: object,
        embedding: torch.Tensor | nn.Module,  # [V, H] table, or an embedding module (its file's codes)
        head: torch.Tensor | None,  # [V, H]; None = tied to the embedding
        norm: torch.Tensor,  # [H]
    ):
        super().__init__()
        self.config = config
        table = embedding
        if isinstance(embedding, torch.Tensor):
            table = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.model = _Inner(cast(nn.Module, table), norm)
        self._head = None if head is None else nn.Parameter(head, False)
        self.eval().requires_grad_(False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head; a tied one is the embedding's table (a table on codes is decoded, once)."""
        weight = self._head
        if weight is None:
            table = cast(torch.Tensor, self.model.embed_tokens.weight)  # [V, H]
            weight = table if isinstance(table, nn.Parameter) else nn.Parameter(table, False)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight = weight
        return head


def read_target_share(
    model_dir: Path, device: str, dtype: torch.dtype, store: Path | None = None
) -> TargetShare:
    """The shared tensors of the checkpoint in `model_dir`, on `device` in `dtype`; with `store` (the
    target's quantized weights, `models/gguf_quant.py`) the embedding in its file's codes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    quantized = None
    if store is not None:
        from specserve.models.gguf_quant import read_store
        from specserve.runtime.int4 import Int4Embedding

        stored = read_store(store, names=(EMBEDDING_KEY,)).get(EMBEDDING_KEY)
        quantized = None if stored is None else Int4Embedding(stored, device, dtype)
    keys = ([EMBEDDING_KEY] if quantized is None else []) + [NORM_KEY] + ([] if tied else [HEAD_KEY])
    tensors = {
        key: t.to(device=device, dtype=dtype) for key, t in read_tensors(Path(model_dir), keys).items()
    }
    head = None if tied else tensors[HEAD_KEY]
    embedding = quantized if quantized is not None else tensors[EMBEDDING_KEY]
    return TargetShare(config, embedding, head, tensors[NORM_KEY])


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
