"""The training loop of a distillation run: one process, AdamW with linear warm-up and cosine decay.
Checkpoints every N steps resume exactly (the batch of step s is a pure function of (seed, s)); held-out
agreement every N steps goes into the log and the plot."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specserve.eagle.model import EagleDraft, save_eagle
from specserve.glide.config import GlideConfig
from specserve.glide.model import GlideDraft, save_glide
from specserve.models import load_causal_lm, load_tokenizer
from specserve.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from specserve.training.device import device_record, to_device, usable_device
from specserve.training.distill.feature_set import FeatureSet, batch_indices
from specserve.training.distill.glide_loss import step_loss
from specserve.training.distill.held_out import held_out_eval, held_out_eval_eagle
from specserve.training.distill.run_log import CHECKPOINTS, LOG, RUN, SUMMARY, log_record, plot_training_log
from specserve.training.distill.settings import DistillSettings
from specserve.training.distill.starting_draft import (
    block_layers,
    eagle_feature_layers,
    new_draft,
    new_eagle_draft,
)
from specserve.training.eagle import eagle_step_loss
from specserve.training.trainer import make_scheduler


def train(
    settings: DistillSettings, model_dir: Path, cache_dir: Path, log: Callable[[str], None] = print
) -> Path:
    device = usable_device(settings.device)  # before anything is loaded or written
    # On a GPU the threads only build batches; on the CPU they run the whole step.
    torch.set_num_threads(settings.threads or os.cpu_count() or 1)
    torch.manual_seed(settings.seed)
    out = Path(settings.out_dir)
    (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    # native: a new draft copies the target's dense head rows (and on CUDA every kernel is cuBLAS's)
    target = load_causal_lm(model_dir, device=settings.device, linear_kernel="native")
    tokenizer = load_tokenizer(model_dir)
    data, layers_of_blocks, feature_layers = _training_data(settings, target.config.num_hidden_layers)
    log(
        f"training data: {len(data)} sequences, {data.answer_tokens} answer tokens "
        f"({settings.fraction:g} of the set)"
    )
    _write_run_info(out, settings, data, device)
    draft: GlideDraft | EagleDraft
    if settings.kind == "eagle":
        draft = new_eagle_draft(settings, target, data)
        evaluate = held_out_eval_eagle(target, tokenizer, settings, cache_dir, feature_layers)
    else:
        draft = new_draft(settings, target, data)
        evaluate = held_out_eval(target, tokenizer, settings, cache_dir, draft.config.feed_layers)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    state: dict[str, Any] = {"step": 0}
    resume = latest_checkpoint(out / CHECKPOINTS)
    if resume is not None:
        state = load_checkpoint(resume, draft, optimizer)
        draft.train()
        log(f"resumed from {resume.name} at step {state['step']}")
    scheduler = make_scheduler(optimizer, settings.steps, settings.warmup_fraction, state["step"])
    if state["step"] == 0:
        (out / LOG).write_text("")
        _eval_record(out, 0, evaluate(draft), log)
    started, window, first = time.monotonic(), [], state["step"]
    window_start, window_tokens = time.monotonic(), 0
    while state["step"] < settings.steps:
        indices = batch_indices(len(data), settings.batch_size, state["step"], settings.seed)
        host_batch = data.batch(indices, layers_of_blocks)  # built from numpy on the CPU
        window_tokens += int(host_batch["loss_mask"].sum())  # counted here: no wait for the device
        loss, metrics = _step_loss(draft, to_device(host_batch, device), settings, state["step"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        state["step"] += 1
        step = state["step"]
        window.append(metrics)
        if step % settings.log_every == 0 or step == settings.steps:
            now = time.monotonic()
            record = {
                "step": step,
                **{k: sum(float(m[k]) for m in window) / len(window) for k in window[0]},
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": now - started,
            }
            eta = (settings.steps - step) * (now - started) / max(1, step - first)
            log_record(
                out,
                record,
                f"step {step}/{settings.steps} loss {record['loss']:.3f} kl {record['kl']:.3f} "
                f"ce {record['ce']:.3f} "
                f"agree {record['accuracy']:.3f} {record['tokens_per_s']:.0f} tok/s eta {eta / 60:.1f} min",
                log,
            )
            window, window_start, window_tokens = [], now, 0
        if step % settings.eval_every == 0 or step == settings.steps:
            draft.eval()
            _eval_record(out, step, evaluate(draft), log)
            draft.train()
            plot_training_log(out)
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            save_checkpoint(out / CHECKPOINTS, draft, optimizer, state)
    _save_draft(draft, out)
    summary = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        **device_record(device),
        "sequences": len(data),
        "answer_tokens": data.answer_tokens,
        "seconds_last_run": round(time.monotonic() - started, 1),
        "size_bytes": (out / "model.safetensors").stat().st_size,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    plot_training_log(out)
    return out


def _training_data(
    settings: DistillSettings, num_target_layers: int
) -> tuple[FeatureSet, list[int], tuple[int, ...]]:
    """-> (the run's features, the target layer each GliDe block reads, the layers a hidden-state draft
    fuses): only what the draft reads is loaded."""
    if settings.kind == "eagle":
        feature_layers = eagle_feature_layers(settings)
        data = FeatureSet.load(
            settings.features, settings.fraction, layers=[], hidden=True, output_layers=feature_layers
        )
        return data, [], feature_layers
    configured = block_layers(settings, num_target_layers)
    if settings.init_from is not None:
        configured = GlideConfig.load(settings.init_from / "config.json").layers_read
    layers_of_blocks = [layer % num_target_layers for layer in configured]
    data = FeatureSet.load(settings.features, settings.fraction, layers=sorted(set(layers_of_blocks)))
    return data, layers_of_blocks, ()


def _write_run_info(out: Path, settings: DistillSettings, data: FeatureSet, device: torch.device) -> None:
    """What a budget curve needs of a run that may never finish (training/budget.py): its kind, batch and
    data."""
    run_info = {
        "kind": settings.kind,
        "batch_size": settings.batch_size,
        "steps": settings.steps,
        "sequences": len(data),
        "answer_tokens": data.answer_tokens,
        **device_record(device),
    }
    (out / RUN).write_text(json.dumps(run_info, indent=2) + "\n")


def _step_loss(
    draft: GlideDraft | EagleDraft, batch: dict[str, torch.Tensor], settings: DistillSettings, step: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics of training step `step` (counted from 0) for either kind of draft."""
    if isinstance(draft, EagleDraft):
        return eagle_step_loss(
            draft,
            batch,
            settings.unroll_steps,
            settings.step_decay,
            settings.kd_weight,
            settings.ce_weight,
            settings.bf16,
            settings.feature_noise,
            (settings.seed, step),
        )
    return step_loss(draft, batch, settings)


def _save_draft(draft: GlideDraft | EagleDraft, out: Path) -> None:
    if isinstance(draft, EagleDraft):
        save_eagle(draft.eval(), out, dtype=torch.bfloat16)
    else:
        save_glide(draft.eval(), out, dtype=torch.bfloat16)


def _eval_record(out: Path, step: int, agreement: Any, log: Callable[[str], None]) -> None:
    log_record(
        out,
        {"step": step, "eval": agreement.to_json()},
        f"eval step {step}: held-out agreement {agreement.overall:.3f}, "
        f"first token {agreement.by_lag[0]:.3f}, "
        f"chain of 4 accepts {agreement.chain_accepted(4):.2f}",
        log,
    )
