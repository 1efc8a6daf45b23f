"""The training set in memory: a run's feature files (feature_extraction.py) as flat arrays, a seeded
fraction of their sequences, and the padded batch of each training step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class FeatureSet:
    tokens: np.ndarray  # [T] uint16
    kv: dict[int, tuple[np.ndarray, np.ndarray]]  # target layer (from 0) -> k, v [T, Hkv, D] fp16
    hidden: np.ndarray | None  # [T, H] fp16, the target's final normed hidden state; None = not loaded
    topk_ids: np.ndarray  # [T, K] uint16
    topk_probs: np.ndarray  # [T, K] fp16
    starts: np.ndarray  # [N] offset of each sequence
    lengths: np.ndarray  # [N]
    prompt_lengths: np.ndarray  # [N]

    @classmethod
    def load(
        cls,
        feature_dir: Path,
        fraction: float = 1.0,
        max_files: int | None = None,
        layers: Sequence[int] | None = None,  # target layers (from 0) to load; None = all stored
        hidden: bool = False,  # load the final hidden states (a hidden-state draft's input)
        output_layers: Sequence[int] = (),  # with `hidden`: these layers' outputs side by side instead
    ) -> FeatureSet:
        """A seeded random `fraction` of the sequences (a smaller fraction is a subset of a larger)."""
        files = sorted(Path(feature_dir).glob("*-shard-*[0-9].npz"))[:max_files]
        parts: dict[str, list[np.ndarray]] = {}
        for f in files:
            with np.load(f, allow_pickle=False) as z:
                stored = sorted(int(name[2:]) for name in z.files if name.startswith("k."))
                wanted = stored if layers is None else list(layers)
                missing = set(wanted) - set(stored)
                if missing:
                    raise FileNotFoundError(f"{f.name} holds target layers {stored}, not {sorted(missing)}")
                names = ["tokens", "topk_ids", "topk_probs", "lengths", "prompt_lengths"]
                names += [f"{kind}.{layer}" for layer in wanted for kind in ("k", "v")]
                if hidden:
                    wanted_states = [f"h.{layer}" for layer in output_layers] or ["hidden"]
                    absent = [name for name in wanted_states if name not in z.files]
                    if absent:
                        raise FileNotFoundError(
                            f"{f.name} holds no {', '.join(absent)}: extract features again "
                            "(--output-layers for a fused draft's layers)"
                        )
                    # [T, k * H]: the layers side by side, as the target's cache keeps them when serving
                    states = [z[name] for name in wanted_states]
                    parts.setdefault("hidden", []).append(
                        states[0] if len(states) == 1 else np.concatenate(states, axis=1)
                    )
                for name in names:
                    parts.setdefault(name, []).append(z[name])
        # one array at a time, each list dropped once joined: the peak is twice the largest array, not
        # twice the whole set (fused layer outputs are several GB)
        cat = {name: np.concatenate(parts.pop(name)) for name in list(parts)}
        lengths = cat.pop("lengths")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        order = np.random.default_rng(0).permutation(len(lengths))
        keep = np.sort(order[: max(1, round(len(lengths) * fraction))])
        kv_layers = sorted(int(name[2:]) for name in cat if name.startswith("k."))
        return cls(
            tokens=cat["tokens"],
            kv={layer: (cat[f"k.{layer}"], cat[f"v.{layer}"]) for layer in kv_layers},
            hidden=cat.get("hidden"),
            topk_ids=cat["topk_ids"],
            topk_probs=cat["topk_probs"],
            starts=starts[keep],
            lengths=lengths[keep],
            prompt_lengths=cat["prompt_lengths"][keep],
        )

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def answer_tokens(self) -> int:
        return int((self.lengths - self.prompt_lengths).sum())

    def batch(self, indices: Sequence[int], block_layers: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-padded: input_ids, loss_mask [B, S]; target_k.<i> / target_v.<i> [B, Hkv, S, D], the
        K/V draft block i reads (target layer block_layers[i]); topk [B, S, K]."""
        width = int(max(self.lengths[i] for i in indices))
        n = len(indices)
        kk = self.topk_ids.shape[1]
        input_ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        kv = {}
        for layer in set(block_layers):
            shape = (n, width, *self.kv[layer][0].shape[1:])  # [B, S, Hkv, D]
            kv[layer] = (torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16))
        ids = torch.zeros((n, width, kk), dtype=torch.long)
        probs = torch.zeros((n, width, kk), dtype=torch.float16)
        hidden = None
        if self.hidden is not None:
            hidden = torch.zeros((n, width, self.hidden.shape[1]), dtype=torch.float16)  # [B, S, H]
        for row, i in enumerate(indices):
            s, L, P = int(self.starts[i]), int(self.lengths[i]), int(self.prompt_lengths[i])
            input_ids[row, :L] = torch.from_numpy(self.tokens[s : s + L].astype(np.int64))
            mask[row, max(P - 1, 0) : L - 1] = True  # predictions of the answer tokens
            for layer, (k, v) in kv.items():
                k[row, :L] = torch.from_numpy(self.kv[layer][0][s : s + L])
                v[row, :L] = torch.from_numpy(self.kv[layer][1][s : s + L])
            ids[row, :L] = torch.from_numpy(self.topk_ids[s : s + L].astype(np.int64))
            probs[row, :L] = torch.from_numpy(self.topk_probs[s : s + L])
            if hidden is not None and self.hidden is not None:
                hidden[row, :L] = torch.from_numpy(self.hidden[s : s + L])
        per_block = {}
        for block, layer in enumerate(block_layers):
            per_block[f"target_k.{block}"] = kv[layer][0].transpose(1, 2)
            per_block[f"target_v.{block}"] = kv[layer][1].transpose(1, 2)
        return {
            "input_ids": input_ids,
            "loss_mask": mask,
            **per_block,
            "topk_ids": ids,
            "topk_probs": probs,
            **({"hidden": hidden} if hidden is not None else {}),
        }

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is the target's argmax over the chosen sequences."""
        top1 = np.concatenate(
            [self.topk_ids[s : s + n, 0] for s, n in zip(self.starts, self.lengths, strict=True)]
        )
        return torch.from_numpy(np.bincount(top1.astype(np.int64), minlength=vocab_size))


def batch_indices(num_sequences: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The sequences of training step `step`: a seeded shuffle per epoch, a pure function of the step."""
    per_epoch = max(1, num_sequences // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = list(range(num_sequences))
    random.Random(seed * 7_919 + epoch).shuffle(order)
    return order[i * batch_size : (i + 1) * batch_size]
