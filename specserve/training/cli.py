"""`specserve train-draft`: build the training data (Ray Data), then train a draft (Ray Train).

Both steps are resumable: data stages that finished are skipped, and training continues from the
newest checkpoint in --out. Set RAY_ADDRESS to run on a Ray cluster instead of this machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.app.model_args import add_model_option
from specserve.settings import EngineSettings
from specserve.training.corpus import Source


def add_train_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train-draft",
        help="train a GliDe (or vanilla) draft for the target on Ray",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, help="where the draft and its checkpoints go (unless --data-only)")
    p.add_argument("--data", type=Path, required=True, help="training data directory (built if missing)")
    p.add_argument("--data-only", action="store_true", help="build the training data and stop")
    p.add_argument(
        "--kind",
        choices=["glide", "vanilla"],
        default="glide",
        help="vanilla = the same block without cross-attention (ablation)",
    )
    add_model_option(p)
    p.add_argument("--model-dir", type=Path, help="the target's directory (default: the --model profile's)")
    data = p.add_argument_group("data")
    data.add_argument(
        "--sources",
        default=",".join(s.value for s in Source),
        help="comma-separated: " + ", ".join(s.value for s in Source),
    )
    data.add_argument("--seq-len", type=int, default=256)
    data.add_argument("--self-prompts", type=int, default=512)
    data.add_argument("--answer-tokens", type=int, default=128)
    data.add_argument("--pydoc-chars", type=int, default=400_000)
    data.add_argument("--stdlib-chars", type=int, default=250_000)
    data.add_argument("--target-layer", type=int, default=-1)
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=2000)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=5e-4)
    train.add_argument("--draft-vocab", type=int, default=8192, help="reduced LM head; 0 = full vocab")
    train.add_argument("--block-size", type=int, default=5)
    train.add_argument("--checkpoint-every", type=int, default=200)
    train.add_argument("--workers", type=int, default=1, help="Ray Train workers (data parallel)")
    train.add_argument("--threads", type=int, help="torch threads per worker (default: all cores)")
    train.add_argument("--fp32", action="store_true", help="train without bf16 autocast")
    train.add_argument(
        "--init-from-target-layer", action="store_true", help="start the block as the target layer it reads"
    )
    train.add_argument(
        "--freeze-head", action="store_true", help="keep the reduced LM head at the target's own rows"
    )
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    train.add_argument("--seed", type=int, default=0)
    return p


def add_train_stopper_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`specserve train-stopper`: see specserve/training/stopper.py."""
    from specserve.drafts import STOPPER_DRAFTS

    p = sub.add_parser(
        "train-stopper",
        help="log drafted tokens from real runs of a draft and train the `decision` stop policy's MLP",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="where model.safetensors and stopper.json go (default: the shipped stopper of --draft)",
    )
    p.add_argument(
        "--draft",
        choices=[kind.value for kind in STOPPER_DRAFTS],
        default=STOPPER_DRAFTS[0].value,
        help="the draft whose tokens are logged",
    )
    add_model_option(p)
    p.add_argument("--model-dir", type=Path, help="the target's directory (default: the --model profile's)")
    p.add_argument("--glide-dir", type=Path, help="the GliDe draft (default: the shipped one)")
    p.add_argument("--eagle-dir", type=Path, help="the hidden-state draft (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=60, help="written prompts to log (never benchmark ones)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=6, help="chain length drafted per logged round")
    p.add_argument("--prompt-seed", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def add_eval_draft_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`specserve eval-draft`: see specserve/training/evaluate.py."""
    p = sub.add_parser(
        "eval-draft",
        help="a draft's agreement with the target per draft position, on held-out answers (MT-Bench)",
    )
    p.add_argument(
        "--draft", type=Path, help="a GliDe or hidden-state draft directory (default: the shipped GliDe one)"
    )
    add_model_option(p)
    p.add_argument("--model-dir", type=Path, help="the target's directory (default: the --model profile's)")
    p.add_argument("--per-category", type=int, default=5, help="MT-Bench first turns per category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    return p


def run_eval_draft_command(args: argparse.Namespace) -> int:
    import json

    from specserve.bench.prompts import load_prompts, per_category
    from specserve.drafts import DraftKind, shipped_draft_dir
    from specserve.eagle.model import is_eagle_dir, load_eagle
    from specserve.errors import InvalidArgument, NotFound
    from specserve.glide.model import load_glide
    from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
    from specserve.training.eagle import held_out_hidden, score_eagle
    from specserve.training.evaluate import evaluate_draft, held_out_answers

    if args.per_category < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise InvalidArgument("--per-category, --max-new-tokens and --batch-size must be positive")
    engine = EngineSettings.from_env(model=args.model, model_dir=args.model_dir)
    model_dir = resolve_model_dir(engine.model_dir, engine.cache_dir, engine.model)
    draft_dir = args.draft or shipped_draft_dir(DraftKind.GLIDE, engine.model)
    if draft_dir is None:
        raise NotFound("no draft given and this build ships none: pass --draft")
    if not (draft_dir / "model.safetensors").is_file():  # before the slow part: loading the target
        raise NotFound(f"{draft_dir} holds no draft (model.safetensors)")
    target = load_causal_lm(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = [p.text for p in per_category(load_prompts(), args.per_category)]
    cache = engine.cache_dir / f"eval-answers-{model_dir.name}-{len(prompts)}x{args.max_new_tokens}.json"
    sequences, starts = held_out_answers(target, tokenizer, prompts, args.max_new_tokens, cache)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if is_eagle_dir(draft_dir):  # the same answers and metric; the draft reads the target's hidden states
        eagle = load_eagle(draft_dir, target)
        layers = eagle.config.feature_layers
        hidden = held_out_hidden(target, sequences, starts, pad_id, args.batch_size, output_layers=layers)
        result = score_eagle(eagle, hidden)
    else:
        glide = load_glide(draft_dir, target)
        result = evaluate_draft(target, glide, sequences, starts, pad_id, args.batch_size)
    print(f"{draft_dir}: agreement {result.overall:.3f} over {sum(result.scored)} answer positions")
    for lag, (rate, n) in enumerate(zip(result.by_lag, result.scored, strict=True), start=1):
        print(
            f"  draft token {lag}: {rate:.3f}  ({n} positions)  chain of {lag} accepts "
            f"{result.chain_accepted(lag):.2f} tokens"
        )
    if args.out is not None:
        record = {"draft": str(draft_dir), "prompts": len(prompts), **result.to_json()}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def run_train_command(args: argparse.Namespace) -> int:
    from specserve.errors import InvalidArgument
    from specserve.models import resolve_model_dir
    from specserve.training.data import build_training_data
    from specserve.training.settings import DataSettings

    engine = EngineSettings.from_env(model=args.model, model_dir=args.model_dir)
    model_dir = resolve_model_dir(engine.model_dir, engine.cache_dir, engine.model)
    try:
        sources = tuple(Source(s.strip()) for s in args.sources.split(",") if s.strip())
    except ValueError as e:
        raise InvalidArgument(f"unknown source in --sources: {e}") from None
    data_settings = DataSettings(
        out_dir=args.data,
        model_dir=model_dir,
        target_layer=args.target_layer,
        seq_len=args.seq_len,
        sources=sources,
        self_prompts=args.self_prompts,
        answer_tokens=args.answer_tokens,
        pydoc_chars=args.pydoc_chars,
        stdlib_chars=args.stdlib_chars,
        seed=args.seed,
    )
    build_training_data(data_settings)
    if args.data_only:
        return 0
    if args.out is None:
        raise InvalidArgument("--out is required to train")
    from specserve.training.settings import TrainSettings
    from specserve.training.trainer import train_draft

    train_draft(
        TrainSettings(
            data_dir=args.data,
            out_dir=args.out,
            model_dir=model_dir,
            cross_attention=args.kind == "glide",
            draft_vocab_size=args.draft_vocab or None,
            block_size=args.block_size,
            batch_size=args.batch_size,
            steps=args.steps,
            lr=args.lr,
            checkpoint_every=args.checkpoint_every,
            num_workers=args.workers,
            num_threads=args.threads,
            bf16=not args.fp32,
            init_from_target_layer=args.init_from_target_layer,
            freeze_head=args.freeze_head,
            weight_decay=args.weight_decay,
            export_dtype=args.export_dtype,
            seed=args.seed,
        )
    )
    return 0
