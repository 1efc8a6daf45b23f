"""Distillation features: a teacher-forced float32 forward of the target over each prompt + answer of a
generation shard (`training/generation.py`) gives, at every position, the K/V of the layers a draft may
read (`k.<layer>` / `v.<layer>`, layer numbers from 0), its top-k next-token probabilities and its argmax,
and what a hidden-state draft reads: the final hidden state and chosen decoder layers' outputs.

One feature file per generation shard, written atomically, so extraction resumes and can run beside
generation; the features are recomputable from the shipped token ids and are never committed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.eagle.config import fused_feature_layers
from specserve.glide.config import spread_target_layers
from specserve.training.distill.settings import DEFAULT_BLOCKS
from specserve.training.features import pad_rows, teacher_forced
from specserve.training.generation import ANSWERS, INSTRUCT, Rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def sequence_features(
    target: PreTrainedModel,  # float32
    sequences: Sequence[Sequence[int]],
    layers: Sequence[int],
    top_k: int,
    chunk: int = 1024,
    hidden_states: bool = True,
    output_layers: Sequence[int] = (),
) -> list[dict[str, np.ndarray]]:
    """Per sequence: k.<layer>, v.<layer> [L, Hkv, D] fp16 for each of `layers`; topk_ids [L, K] uint16;
    topk_probs [L, K] fp16; with `hidden_states`, `hidden` [L, H] fp16: the target's final hidden state
    after its last norm (what its LM head reads), the input of a hidden-state draft (specserve/eagle);
    h.<layer> [L, H] fp16 for each of `output_layers`: that decoder layer's output, before any norm (the
    fused input of a multi-layer hidden-state draft).

    One right-padded batch through `features.teacher_forced` (every real position's values are those of
    an unpadded run), on the target's device. Logits are formed a chunk of positions at a time (never
    [B, S, V]). Each array comes back to the CPU once, already fp16, for numpy.
    """
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    device = next(target.parameters()).device
    input_ids = pad_rows(sequences, width, pad_id=0).to(device, non_blocking=True)  # [B, S]
    passed = teacher_forced(target, input_ids, layers, output_layers)
    hidden = passed.hidden  # [B, S, H]
    outputs = {layer: out.to(torch.float16).cpu() for layer, out in passed.layer_outputs.items()}
    # target layer (from 0) -> keys, values [B, S, Hkv, D], fp16 on the CPU
    kv = {
        layer: (k.transpose(1, 2).to(torch.float16).cpu(), v.transpose(1, 2).to(torch.float16).cpu())
        for layer, (k, v) in passed.kv.items()
    }
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*S, H]
    ids, probs = [], []
    for start in range(0, flat.shape[0], chunk):
        logits = target.lm_head(flat[start : start + chunk]).float()  # [C, V]
        top = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids.append(top.indices)
        probs.append(top.values)
    topk_ids = torch.cat(ids).view(len(sequences), width, top_k).cpu()
    topk_probs = torch.cat(probs).view(len(sequences), width, top_k).cpu()
    hidden_fp16 = hidden.to(torch.float16).cpu() if hidden_states else None
    result = []
    for i, n in enumerate(lengths):
        row = {}
        for layer, (keys, values) in kv.items():
            row[f"k.{layer}"] = keys[i, :n].numpy()
            row[f"v.{layer}"] = values[i, :n].numpy()
        if hidden_fp16 is not None:
            row["hidden"] = hidden_fp16[i, :n].numpy()
        for layer, states in outputs.items():
            row[f"h.{layer}"] = states[i, :n].numpy()
        result.append(
            {
                **row,
                "topk_ids": topk_ids[i, :n].numpy().astype(np.uint16),
                "topk_probs": topk_probs[i, :n].to(torch.float16).numpy(),
            }
        )
    return result


def shard_features(
    target: PreTrainedModel,
    rows: Rows,
    layers: Sequence[int],
    top_k: int,
    max_len: int,
    batch_tokens: int,
    output_layers: Sequence[int] = (),
) -> dict[str, np.ndarray]:
    """Features of every row of a generation shard, flat over positions, in row order."""
    seqs = [(p + a)[:max_len] for p, a in rows.sequences()]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    per_row: list[dict[str, np.ndarray] | None] = [None] * len(seqs)
    batch: list[int] = []
    for i in [*order, None]:
        if i is not None and (not batch or (len(batch) + 1) * len(seqs[i]) <= batch_tokens):
            batch.append(i)
            continue
        for j, feats in zip(
            batch,
            sequence_features(target, [seqs[j] for j in batch], layers, top_k, output_layers=output_layers),
            strict=True,
        ):
            per_row[j] = feats
        batch = [i] if i is not None else []
    done = [r for r in per_row if r is not None]
    assert len(done) == len(seqs)
    return {
        "tokens": np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs]),
        "lengths": np.asarray([len(s) for s in seqs], dtype=np.int32),
        "prompt_lengths": np.minimum(rows.prompt_lengths, [len(s) for s in seqs]).astype(np.int32),
        "temperature": rows.temperature,
        **{name: np.concatenate([r[name] for r in done]) for name in done[0]},
    }


def extract_features(
    target: PreTrainedModel,
    data_dir: Path,
    out_dir: Path,
    layers: Sequence[int] | None = None,  # None: the layers a default draft reads
    top_k: int = 32,
    max_len: int = 512,
    batch_tokens: int = 4096,
    follow: bool = False,  # keep polling for new generation shards (run beside generation)
    log: Callable[[str], None] = print,
    output_layers: Sequence[int] | None = None,  # None: the layers a fused hidden-state draft reads
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    num_layers = target.config.num_hidden_layers
    if layers is None:
        layers = spread_target_layers(DEFAULT_BLOCKS, num_layers)
    if output_layers is None:
        output_layers = fused_feature_layers(num_layers)
    output_layers = sorted({layer % num_layers for layer in output_layers})
    while True:
        todo = []
        for stage in (INSTRUCT, ANSWERS):
            for shard in sorted((data_dir / stage).glob("shard-*[0-9].npz")):
                dest = out_dir / f"{stage}-{shard.stem}.npz"
                if not dest.is_file():
                    todo.append((shard, dest))
        for shard, dest in todo:
            started = time.monotonic()
            feats = shard_features(
                target, Rows.load(shard), layers, top_k, max_len, batch_tokens, output_layers
            )
            tmp = dest.with_name(dest.name + ".tmp.npz")
            np.savez(tmp, allow_pickle=False, **feats)
            os.replace(tmp, dest)
            seconds = time.monotonic() - started
            log(
                f"features {dest.name}: {len(feats['tokens'])} tokens in {seconds:.0f} s "
                f"({len(feats['tokens']) / seconds:.0f} tok/s)"
            )
        if not follow:
            return
        if not todo:
            time.sleep(30)
