"""`specserve train-draft` step 2: train a one-layer GliDe (or vanilla) draft with Ray Train.

The draft starts from the target where that is free: it shares the target's input embedding (frozen,
not stored) and its reduced LM head starts as the target's own output rows for the draft vocabulary,
with the target's final norm; the block itself starts random. The loss is cross-entropy against the
target's greedy next token under training's block-wise cross-attention mask (algorithms.md section 1).
AdamW, betas (0.9, 0.95), linear warm-up then cosine decay, as the paper trains.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from specserve.glide.model import (
    GlideDraft,
    blockwise_cross_mask,
    build_glide,
    frequency_ranked_ids,
    save_glide,
)
from specserve.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from specserve.training.data import COUNTS, FEATURES, MANIFEST, init_ray, jsonable
from specserve.training.device import bf16_autocast
from specserve.training.features import IGNORE
from specserve.training.settings import TrainSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHECKPOINTS, LOG, SUMMARY = "checkpoints", "training_log.jsonl", "training.json"
Batch = dict[str, torch.Tensor]


# --- pure pieces: schedule, one step ------------------------------------------------------------


def warmup_cosine(step: int, total: int, warmup_fraction: float) -> float:
    """Learning-rate multiplier: linear from 0 to 1 over the warm-up, then cosine down to 0 at `total`."""
    warmup = max(1, round(total * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def draft_loss(
    model: GlideDraft, batch: Batch, cross_mask: torch.Tensor, forward: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (mean cross-entropy, top-1 agreement with the target) over the positions the head can score.

    batch: input_ids [B, S], labels [B, S] (target argmax; IGNORE = padding), target_k/v [B, Hkv, S, D].
    forward: what runs the blocks, `model` itself unless it is wrapped (DistributedDataParallel must
    see the forward, or its backward never all-reduces the gradients).
    """
    dtype = next(model.parameters()).dtype
    kv = (batch["target_k"].to(dtype), batch["target_v"].to(dtype))
    hidden = (forward or model)(batch["input_ids"].long(), kv, cross_mask)  # [B, S, H]
    labels = batch["labels"].long()  # [B, S]
    loss = model.loss(hidden, labels)
    with torch.no_grad():
        scores = model.draft_logits(hidden)  # [B, S, V_draft]
        index = labels.clamp_min(0)
        if model.config.draft_vocab_size is not None:
            index = model.draft_index[index]  # -100 where the head cannot score the label
        scored = (labels != IGNORE) & (index >= 0)
        agree = (scores.argmax(-1) == index) & scored
        accuracy = agree.sum() / scored.sum().clamp_min(1)
    return loss, accuracy


def train_step(
    model: nn.Module,
    batch: Batch,
    cross_mask: torch.Tensor,  # [S, S] bool
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    bf16: bool = False,
) -> tuple[float, float]:
    # Several Ray Train workers: `prepare_model` wrapped the draft in DistributedDataParallel.
    draft = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(draft, GlideDraft)
    with bf16_autocast(next(draft.parameters()).device, bf16):
        loss, accuracy = draft_loss(draft, batch, cross_mask, forward=model)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    return float(loss.detach()), float(accuracy)


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine from `start_step` (a resumed run's optimizer state carries `initial_lr`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps, warmup_fraction), last_epoch=start_step - 1
    )


# --- the draft to train ------------------------------------------------------------------------


def new_draft(settings: TrainSettings, target: PreTrainedModel, target_layer: int) -> GlideDraft:
    """A draft for `target` whose reduced head and final norm start as the target's own."""
    ids = None
    if settings.draft_vocab_size is not None:
        from safetensors.torch import load_file

        counts = load_file(str(Path(settings.data_dir) / COUNTS))["counts"]
        full = torch.zeros(target.config.vocab_size, dtype=torch.long)
        full[: len(counts)] = counts
        ids = frequency_ranked_ids(full, settings.draft_vocab_size)
    overrides: dict[str, Any] = {
        "share_target_embeddings": True,
        "draft_vocab_size": settings.draft_vocab_size,
        "cross_attention": settings.cross_attention,
        "block_size": settings.block_size,
        "target_layer": target_layer,
    }
    if settings.intermediate_size is not None:
        overrides["intermediate_size"] = settings.intermediate_size
    draft = build_glide(target, seed=settings.seed, draft_token_ids=ids, **overrides)
    with torch.no_grad():
        head = target.get_output_embeddings().weight  # [V, H]
        draft.lm_head.weight.copy_(head if ids is None else head[ids])
        draft.norm.weight.copy_(target.model.norm.weight)
        if settings.init_from_target_layer:
            copy_target_layer(draft, target.model.layers[target_layer])
    draft = draft.float().train().requires_grad_(True)
    draft.lm_head.weight.requires_grad_(not settings.freeze_head)
    return draft


def copy_target_layer(draft: GlideDraft, layer: nn.Module) -> bool:
    """Starts the draft block as the target layer whose K/V it reads, when the geometry matches.

    That layer's attention already turns a query into a read of exactly those cached K/V, so its q/o
    projections are a far better start for cross-attention than noise (and its own attention and MLP
    for the draft's). Returns False, changing nothing, when shapes differ (a narrower draft).
    """
    block = draft.layers[0]
    names = [(n, n) for n in ("input_layernorm", "post_attention_layernorm", *_ATTN, *_MLP)]  # (mine, theirs)
    if block.cross_attn is not None:
        names += [("cross_attn.q_proj", "self_attn.q_proj"), ("cross_attn.o_proj", "self_attn.o_proj")]
    pairs = [(block.get_parameter(f"{m}.weight"), layer.get_parameter(f"{t}.weight")) for m, t in names]
    if any(mine.shape != theirs.shape for mine, theirs in pairs):
        return False
    for mine, theirs in pairs:
        mine.copy_(theirs)
    return True


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# --- the Ray Train worker ------------------------------------------------------------------------


def train_loop(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker; rank 0 writes checkpoints and the log."""
    import ray.train

    from specserve.models import load_causal_lm

    settings: TrainSettings = config["settings"]
    torch.set_num_threads(settings.num_threads or os.cpu_count() or 1)
    torch.manual_seed(settings.seed)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    out = Path(settings.out_dir)
    target = load_causal_lm(Path(settings.model_dir))
    draft = new_draft(settings, target, config["target_layer"])
    del target  # the draft keeps only the embedding it shares
    model: nn.Module = draft
    if world > 1:
        model = ray.train.torch.prepare_model(draft, move_to_device=False)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
    )
    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0}
    resume = latest_checkpoint(out / CHECKPOINTS)
    if resume is not None:
        state = load_checkpoint(resume, draft, optimizer)
        _log(rank, f"resumed from {resume} at step {state['step']}")
    scheduler = make_scheduler(optimizer, settings.steps, settings.warmup_fraction, state["step"])
    first_step = state["step"]
    cross_mask = blockwise_cross_mask(config["seq_len"], settings.block_size)  # [S, S], built once
    shard = ray.train.get_dataset_shard("train")
    started, window_start, window_tokens = time.monotonic(), time.monotonic(), 0
    losses: list[float] = []
    accuracies: list[float] = []
    while state["step"] < settings.steps:
        skip = state["batches_in_epoch"]  # after a resume: batches this epoch already trained on
        for batch in shard.iter_torch_batches(
            batch_size=settings.batch_size, drop_last=True, local_shuffle_buffer_size=None
        ):
            if skip:
                skip -= 1
                continue
            loss, accuracy = train_step(
                model, batch, cross_mask, optimizer, scheduler, settings.grad_clip, settings.bf16
            )
            losses.append(loss)
            accuracies.append(accuracy)
            window_tokens += batch["input_ids"].numel() * world
            state["step"] += 1
            state["batches_in_epoch"] += 1
            step = state["step"]
            if step % settings.log_every == 0 or step == settings.steps:
                now = time.monotonic()
                record = {
                    "step": step,
                    "epoch": state["epoch"],
                    "loss": sum(losses) / len(losses),
                    "accuracy": sum(accuracies) / len(accuracies),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                    "elapsed_s": now - started,
                }
                losses.clear()
                accuracies.clear()
                window_start, window_tokens = now, 0
                eta = (settings.steps - step) * record["elapsed_s"] / max(1, step - first_step)
                _log(
                    rank,
                    f"step {step}/{settings.steps}  loss {record['loss']:.3f}  "
                    f"agree {record['accuracy']:.3f}  "
                    f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s  eta {eta / 60:.1f} min",
                )
                if rank == 0:
                    with open(out / LOG, "a") as f:
                        f.write(json.dumps(record) + "\n")
                ray.train.report({k: v for k, v in record.items() if k != "epoch"})
            if rank == 0 and (step % settings.checkpoint_every == 0 or step == settings.steps):
                save_checkpoint(out / CHECKPOINTS, draft, optimizer, state)
            if step >= settings.steps:
                break
        else:
            state["epoch"] += 1
            state["batches_in_epoch"] = 0
    if rank == 0:
        save_glide(draft.eval(), out, dtype=getattr(torch, settings.export_dtype))


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


# --- the driver ------------------------------------------------------------------------------------


def train_draft(settings: TrainSettings, log: Callable[[str], None] = print) -> Path:
    """Trains (or resumes) a draft into `settings.out_dir`; returns that directory."""
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    init_ray()
    data = Path(settings.data_dir)
    manifest = json.loads((data / MANIFEST).read_text())
    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / CHECKPOINTS).mkdir(exist_ok=True)
    started = time.monotonic()
    columns = ["input_ids", "labels", "target_k", "target_v"]
    dataset = ray.data.read_parquet(str(data / FEATURES)).select_columns(columns)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "settings": settings,
            "seq_len": manifest["settings"]["seq_len"],
            "target_layer": manifest["settings"]["target_layer"],
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=settings.num_workers,
            use_gpu=False,
            resources_per_worker={"CPU": settings.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name="train-draft",
            storage_path=str(out / "ray"),
            # A crashed worker restarts and resumes from the newest checkpoint in out_dir.
            failure_config=ray.train.FailureConfig(max_failures=2),
        ),
        datasets={"train": dataset},
    )
    trainer.fit()
    summary = {
        "settings": jsonable(asdict(settings)),
        "data": manifest,
        "seconds_this_run": round(time.monotonic() - started, 1),
        "parameters_stored": _stored_parameters(out),
        "size_bytes": (out / "model.safetensors").stat().st_size,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out)
    log(f"draft saved in {out} ({summary['size_bytes'] / 1e6:.1f} MB)")
    return out


def _stored_parameters(out: Path) -> int:
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    return sum(t.numel() for name, t in weights.items() if name != "draft_token_ids")


def _plot(out: Path) -> None:
    """training.png: loss and agreement with the target over the steps of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (out / LOG).read_text().splitlines() if line.strip()]
    if not records:
        return
    steps = [r["step"] for r in records]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, [r["loss"] for r in records])
    a.set(xlabel="step", ylabel="loss (CE vs target argmax)", title="training loss")
    b.plot(steps, [r["accuracy"] for r in records], color="tab:green")
    b.set(xlabel="step", ylabel="top-1 agreement", title="draft argmax == target argmax")
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=120)
    plt.close(fig)
