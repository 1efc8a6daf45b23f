"""Knowledge distillation of a GliDe draft from the target's own answers (see `generation.py`).

1. Features: a teacher-forced float32 forward of the target over each prompt + answer gives, at every
   position, the K/V of the layers a draft may read (`k.<layer>` / `v.<layer>`, layer numbers from 0),
   its top-k next-token probabilities and its argmax. `--weights as-shipped`: the target on the model
   file's own quantized weights, as a draft serving beside that target reads it.
   One feature file per generation shard, written atomically, so extraction resumes and can run beside
   generation; the features are recomputable from the shipped token ids and are never committed.
2. Training: loss = kd_weight * KL(target top-k, renormalised || draft) + ce_weight * CE(draft, argmax),
   over the answer positions (from the last prompt token on), under training's block-wise cross mask.
   A plain loop in one process (AdamW, warm-up + cosine); checkpoints every N steps resume exactly
   (the batch of step s is a pure function of (seed, s)); held-out agreement (`eval-draft`'s MT-Bench
   answers and metric) every N steps goes into the log and the plot.
"""

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from specserve.models import resolve_model_dir
from specserve.runtime.target_runtime import TargetRuntime
from specserve.settings import WEIGHTS, EngineSettings
from specserve.training.device import usable_device
from specserve.training.distill.curve import scaling_curve
from specserve.training.distill.feature_extraction import extract_features
from specserve.training.distill.loop import train
from specserve.training.distill.settings import DEFAULT_BLOCKS, DistillSettings


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m specserve.training.distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("features", help="target features of generated answers (resumable)")
    f.add_argument("--data", type=Path, required=True, help="the generation directory")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--top-k", type=int, default=32)
    f.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="target layers whose K/V is kept (-1 = the last); default: those a default draft reads",
    )
    f.add_argument("--max-len", type=int, default=512)
    f.add_argument(
        "--batch-tokens", type=int, default=4096, help="padded tokens per target forward (larger on a GPU)"
    )
    f.add_argument("--follow", action="store_true", help="keep extracting new shards as they appear")
    f.add_argument(
        "--output-layers",
        type=int,
        nargs="*",
        help="decoder layers whose outputs are kept for a fused hidden-state draft (default: low, middle, "
        "high: 2, L/2, L-3)",
    )
    f.add_argument("--threads", type=int)
    f.add_argument(
        "--weights",
        choices=WEIGHTS,
        help="the target's weights (default: SPECSERVE_WEIGHTS, else dense): the features are those of "
        "the target a draft will serve beside",
    )
    t = sub.add_parser("train", help="distil a GliDe draft (resumes from --out)")
    t.add_argument("--features", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--fraction", type=float, default=1.0)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--kd-weight", type=float, default=1.0)
    t.add_argument("--ce-weight", type=float, default=1.0)
    t.add_argument("--init-from", type=Path, help="start from a trained draft (its shape is kept)")
    t.add_argument("--draft-vocab-size", type=int, default=8192, help="rows of the reduced head")
    t.add_argument("--num-layers", type=int, default=DEFAULT_BLOCKS, help="draft blocks")
    t.add_argument(
        "--block-target-layers",
        type=int,
        nargs="+",
        help="the target layer each draft block reads (-1 = the last); default: spread through the "
        "target's depth, ending at the last (2 blocks of a 30-layer target: 14 29)",
    )
    t.add_argument(
        "--kind",
        choices=("glide", "eagle"),
        default="glide",
        help="glide: reads the target's K/V; eagle: reads its final hidden states (features must hold them)",
    )
    t.add_argument("--unroll-steps", type=int, default=3, help="eagle: steps reading its own outputs")
    t.add_argument(
        "--feature-layers",
        type=int,
        nargs="*",
        default=[],
        help="eagle: target decoder layers whose outputs are the fused input (e.g. 2 15 27; the features "
        "must hold them: `features --output-layers`); none = the final normed hidden state",
    )
    t.add_argument(
        "--train-head", action="store_true", help="eagle: train the reduced head too (default: frozen)"
    )
    t.add_argument(
        "--feature-noise",
        type=float,
        default=0.0,
        help="eagle: half-width of uniform noise added to the target's features in training (0 = none)",
    )
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument(
        "--eval-per-category",
        type=int,
        default=DistillSettings.eval_per_category,
        help="held-out MT-Bench first turns per category",
    )
    t.add_argument("--eval-max-new-tokens", type=int, default=DistillSettings.eval_max_new_tokens)
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--threads", type=int)
    t.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("curve", help="table and plot of finished runs that differ in --fraction")
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--png", type=Path, required=True)
    for sp in (f, t):
        sp.add_argument("--model-dir", type=Path)
        sp.add_argument(
            "--device",
            default=DistillSettings.device,
            help="cpu, cuda or cuda:N: where the target (and the draft) run",
        )
    args = p.parse_args(argv)
    if args.command == "curve":
        for point in scaling_curve(args.runs, args.png):
            print(json.dumps(point))
        return
    usable_device(args.device)  # before a model is looked for, loaded or written
    engine = EngineSettings.from_env(
        model_dir=args.model_dir, weights=getattr(args, "weights", None), device=args.device
    )
    model_dir = resolve_model_dir(engine.model_dir, engine.cache_dir, engine.model)
    if args.command == "features":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        # The served target's runtime: with dense weights, oneDNN-packed on a CPU and cuBLAS on CUDA
        # (nothing here reads a weight directly); float32, with torch's default of no TF32 on CUDA.
        target = TargetRuntime(engine).target_model
        extract_features(
            target,
            args.data,
            args.out,
            layers=args.layers,
            top_k=args.top_k,
            max_len=args.max_len,
            batch_tokens=args.batch_tokens,
            follow=args.follow,
            log=lambda m: print(m, flush=True),
            output_layers=args.output_layers,
        )
        return
    settings = DistillSettings(
        features=args.features,
        out_dir=args.out,
        fraction=args.fraction,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        kd_weight=args.kd_weight,
        ce_weight=args.ce_weight,
        init_from=args.init_from,
        draft_vocab_size=args.draft_vocab_size,
        num_layers=args.num_layers,
        block_target_layers=None if args.block_target_layers is None else tuple(args.block_target_layers),
        eval_every=args.eval_every,
        eval_per_category=args.eval_per_category,
        eval_max_new_tokens=args.eval_max_new_tokens,
        checkpoint_every=args.checkpoint_every,
        threads=args.threads,
        seed=args.seed,
        kind=args.kind,
        unroll_steps=args.unroll_steps,
        feature_layers=tuple(args.feature_layers),
        train_head=args.train_head,
        feature_noise=args.feature_noise,
        weight_decay=args.weight_decay,
        device=args.device,
    )
    train(settings, model_dir, engine.cache_dir, log=lambda m: print(m, flush=True))
