"""Knowledge distillation of a GliDe draft from the target's own answers (see `generation.py`).

1. Features: a teacher-forced float32 forward of the target over each prompt + answer gives, at every
   position, the K/V of the layers a draft may read (`k.<layer>` / `v.<layer>`, layer numbers from 0),
   its top-k next-token probabilities and its argmax.
   One feature file per generation shard, written atomically, so extraction resumes and can run beside
   generation; the features are recomputable from the shipped token ids and are never committed.
2. Training: loss = kd_weight * KL(target top-k, renormalised || draft) + ce_weight * CE(draft, argmax),
   over the answer positions (from the last prompt token on), under training's block-wise cross mask.
   A plain loop in one process (AdamW, warm-up + cosine); checkpoints every N steps resume exactly
   (the batch of step s is a pure function of (seed, s)); held-out agreement (`eval-draft`'s MT-Bench
   answers and metric) every N steps goes into the log and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve.eagle.config import EagleConfig, fused_feature_layers
from specserve.eagle.model import EagleDraft, build_eagle, load_eagle, save_eagle
from specserve.errors import InvalidArgument
from specserve.glide.config import GlideConfig, spread_target_layers
from specserve.glide.model import (
    GlideDraft,
    blockwise_cross_mask,
    build_glide,
    frequency_ranked_ids,
    save_glide,
)
from specserve.training.device import bf16_autocast, device_record, parse_device, to_device, usable_device
from specserve.training.eagle import eagle_step_loss
from specserve.training.features import pad_rows, teacher_forced
from specserve.training.generation import ANSWERS, INSTRUCT, Rows
from specserve.training.kd import kd_loss

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specserve.models.loading import CausalLM

FEATURES, CHECKPOINTS, LOG, SUMMARY = "features", "checkpoints", "training_log.jsonl", "training.json"
RUN = "run.json"  # written when a run starts: its kind, batch size and data
DEFAULT_BLOCKS = 2  # a draft trained from scratch: two blocks, reading layers spread through the target

# --- features ----------------------------------------------------------------------------------------------


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


# --- the training set in memory --------------------------------------------------------------------------


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


# --- training ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillSettings:
    features: Path
    out_dir: Path
    fraction: float = 1.0  # of the feature set's sequences (the data-scaling curve)
    steps: int = 1000
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    warmup_fraction: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 1.0
    draft_vocab_size: int = 8192  # rows of the reduced head (the most frequent target labels)
    num_layers: int = DEFAULT_BLOCKS  # draft blocks
    # the target layer each block reads; None = spread through the target's depth (glide/config.py)
    block_target_layers: tuple[int, ...] | None = None
    block_size: int = 5
    init_from: Path | None = None  # start from a trained draft (its head ids are kept)
    bf16: bool = True
    eval_every: int = 100
    log_every: int = 10
    checkpoint_every: int = 100
    eval_per_category: int = 5  # MT-Bench first turns per category, as `eval-draft`
    eval_max_new_tokens: int = 128
    threads: int | None = None
    seed: int = 0
    # "glide" (reads the target's K/V) or "eagle" (reads its final hidden states: specserve/eagle)
    kind: str = "glide"
    unroll_steps: int = 3  # eagle: training-time test, steps of the draft reading its own outputs
    step_decay: float = 0.8  # eagle: weight of step j's loss is step_decay**j
    train_head: bool = False  # eagle: also train the reduced head (else it stays the target's rows)
    # eagle: half-width of the uniform noise added to the target's features in training (EAGLE's
    # augmentation); 0 = none. The final normed state of the default model has an RMS of about 2.
    feature_noise: float = 0.0
    # eagle: target decoder layers whose outputs are the draft's fused input; () = the final normed state
    feature_layers: tuple[int, ...] = ()
    # "cpu", "cuda" or "cuda:N": where the target, the draft and every batch live (bf16 autocast on either)
    device: str = "cpu"
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_device(self.device)  # the name only: whether this machine has the GPU is `train`'s check
        if self.feature_noise < 0 or (self.feature_noise > 0 and self.kind != "eagle"):
            raise InvalidArgument("feature_noise is a non-negative half-width, for hidden-state drafts only")
        if self.weight_decay < 0:
            raise InvalidArgument("weight_decay must be non-negative")


def block_layers(settings: DistillSettings, num_target_layers: int) -> tuple[int, ...]:
    """The target layer each block of a draft trained from scratch reads."""
    if settings.block_target_layers is not None:
        return settings.block_target_layers
    return spread_target_layers(settings.num_layers, num_target_layers)


def new_draft(settings: DistillSettings, target: PreTrainedModel, data: FeatureSet) -> GlideDraft:
    from specserve.glide.model import load_glide

    if settings.init_from is not None:
        draft = load_glide(settings.init_from, target)
    else:
        ids = frequency_ranked_ids(data.label_counts(target.config.vocab_size), settings.draft_vocab_size)
        draft = build_glide(
            target,
            seed=settings.seed,
            draft_token_ids=ids,
            share_target_embeddings=True,
            draft_vocab_size=settings.draft_vocab_size,
            block_size=settings.block_size,
            num_layers=settings.num_layers,
            block_target_layers=block_layers(settings, target.config.num_hidden_layers),
        )
        with torch.no_grad():
            head = target.get_output_embeddings().weight  # [V, H] on the target's device
            draft.lm_head.weight.copy_(head[ids.to(head.device)])
            draft.norm.weight.copy_(target.model.norm.weight)
    return draft.float().train().requires_grad_(True)


def new_eagle_draft(settings: DistillSettings, target: PreTrainedModel, data: FeatureSet) -> EagleDraft:
    """A hidden-state draft: from `init_from`, or the layer random with the target's head rows and norm."""
    if settings.init_from is not None:
        draft = load_eagle(settings.init_from, target)
    else:
        ids = frequency_ranked_ids(data.label_counts(target.config.vocab_size), settings.draft_vocab_size)
        draft = build_eagle(
            target,
            seed=settings.seed,
            draft_token_ids=ids,
            draft_vocab_size=settings.draft_vocab_size,
            feature_layers=eagle_feature_layers(settings),
        )
    draft = draft.float().train().requires_grad_(True)
    if not settings.train_head:
        # EAGLE's choice: the head stays the target's own rows. It is most of a step's arithmetic (8,192
        # rows against a one-layer body), so freezing it also saves a third of that cost.
        draft.lm_head.requires_grad_(False)
    return draft


def eagle_feature_layers(settings: DistillSettings) -> tuple[int, ...]:
    """The target layers a hidden-state run reads: its starting draft's, else the settings'."""
    if settings.init_from is not None:
        return EagleConfig.load(settings.init_from / "config.json").feature_layers
    return tuple(settings.feature_layers)


def step_loss(
    draft: GlideDraft, batch: dict[str, torch.Tensor], settings: DistillSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (loss, metrics). `batch` is on the draft's device; the metrics are 0-d tensors there, read
    only when a log line is written, so a GPU is not made to wait for them every step."""
    dtype = torch.float32
    device = batch["input_ids"].device
    width = batch["input_ids"].shape[1]
    cross = blockwise_cross_mask(width, draft.config.block_size).to(device)  # [S, S]
    blocks = range(draft.config.num_layers)
    kv = [(batch[f"target_k.{i}"].to(dtype), batch[f"target_v.{i}"].to(dtype)) for i in blocks]
    with bf16_autocast(device, settings.bf16):
        hidden = draft(batch["input_ids"], kv, cross)  # [B, S, H]
        positions = batch["loss_mask"]  # [B, S]
        scores = draft.draft_logits(hidden[positions])  # [N, V_draft]
    index = draft.draft_index  # [V] full id -> head index, -100 outside
    topk = index[batch["topk_ids"][positions]]  # [N, K]
    topk = torch.where(topk >= 0, topk, torch.full_like(topk, -1))
    labels = index[batch["topk_ids"][positions][:, 0]]  # [N]
    loss, kl, ce = kd_loss(
        scores, topk, batch["topk_probs"][positions], labels, settings.kd_weight, settings.ce_weight
    )
    with torch.no_grad():
        scored = labels >= 0
        agree = (scores.argmax(-1) == labels) & scored
        accuracy = agree.sum() / scored.sum().clamp_min(1)
    return loss, {"loss": loss.detach(), "kl": kl, "ce": ce, "accuracy": accuracy}


def held_out_eval(
    target: CausalLM, tokenizer: Any, settings: DistillSettings, cache_dir: Path, layers: Sequence[int]
):
    """-> a function draft -> Agreement on `eval-draft`'s held-out MT-Bench answers (features cached)."""
    from specserve.bench.prompts import load_prompts, per_category
    from specserve.training.evaluate import held_out_answers, held_out_features, score_draft

    prompts = [p.text for p in per_category(load_prompts(), settings.eval_per_category)]
    name = Path(target.config._name_or_path).name or "target"
    cache = cache_dir / f"eval-answers-{name}-{len(prompts)}x{settings.eval_max_new_tokens}.json"
    sequences, starts = held_out_answers(target, tokenizer, prompts, settings.eval_max_new_tokens, cache)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    suffix = "-".join(map(str, layers))
    features_cache = cache.with_name(cache.stem + f"-features-layers{suffix}.safetensors")
    batches = _cached_features(
        features_cache, len(sequences), lambda: held_out_features(target, sequences, starts, pad, layers, 8)
    )
    return lambda draft: score_draft(draft, batches, settings.block_size)


def held_out_eval_eagle(
    target: CausalLM,
    tokenizer: Any,
    settings: DistillSettings,
    cache_dir: Path,
    feature_layers: Sequence[int] = (),
):
    """`held_out_eval` for a hidden-state draft: the same answers, the target's hidden states (or the
    outputs of `feature_layers` side by side, for a fused draft)."""
    from specserve.bench.prompts import load_prompts, per_category
    from specserve.training.eagle import held_out_hidden, score_eagle
    from specserve.training.evaluate import held_out_answers

    prompts = [p.text for p in per_category(load_prompts(), settings.eval_per_category)]
    name = Path(target.config._name_or_path).name or "target"
    cache = cache_dir / f"eval-answers-{name}-{len(prompts)}x{settings.eval_max_new_tokens}.json"
    sequences, starts = held_out_answers(target, tokenizer, prompts, settings.eval_max_new_tokens, cache)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kind = "hidden" + "".join(f"-{layer}" for layer in feature_layers)
    features_cache = cache.with_name(cache.stem + f"-features-{kind}.safetensors")
    batches = _cached_features(
        features_cache,
        len(sequences),
        lambda: held_out_hidden(target, sequences, starts, pad, output_layers=feature_layers),
    )
    return lambda draft: score_eagle(draft, batches)


def _cached_features(
    path: Path, count: int, compute: Callable[[], list[dict[str, torch.Tensor]]]
) -> list[dict[str, torch.Tensor]]:
    """The held-out batches' target features, computed once (a target forward) and kept as safetensors."""
    from safetensors.torch import load_file, save_file

    if path.is_file():
        flat = load_file(str(path))
        batches: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            index, name = key.split(".", 1)
            batches.setdefault(int(index), {})[name] = value
        result = [batches[i] for i in sorted(batches)]
        if sum(len(b["input_ids"]) for b in result) == count:
            return result
    result = compute()
    tmp = path.with_name(path.name + ".tmp")
    save_file({f"{i}.{k}": v.contiguous() for i, b in enumerate(result) for k, v in b.items()}, str(tmp))
    os.replace(tmp, path)
    return result


def train(
    settings: DistillSettings, model_dir: Path, cache_dir: Path, log: Callable[[str], None] = print
) -> Path:
    from specserve.models import load_causal_lm, load_tokenizer
    from specserve.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from specserve.training.trainer import make_scheduler

    device = usable_device(settings.device)  # before anything is loaded or written
    # On a GPU the threads only build batches; on the CPU they run the whole step.
    torch.set_num_threads(settings.threads or os.cpu_count() or 1)
    torch.manual_seed(settings.seed)
    out = Path(settings.out_dir)
    (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    # native: a new draft copies the target's dense head rows (and on CUDA every kernel is cuBLAS's)
    target = load_causal_lm(model_dir, device=settings.device, linear_kernel="native")
    tokenizer = load_tokenizer(model_dir)
    eagle = settings.kind == "eagle"
    if eagle:
        layers_of_blocks: list[int] = []
        feature_layers = eagle_feature_layers(settings)
        data = FeatureSet.load(
            settings.features, settings.fraction, layers=[], hidden=True, output_layers=feature_layers
        )
    else:
        configured = block_layers(settings, target.config.num_hidden_layers)
        if settings.init_from is not None:
            configured = GlideConfig.load(settings.init_from / "config.json").layers_read
        layers_of_blocks = [layer % target.config.num_hidden_layers for layer in configured]
        data = FeatureSet.load(settings.features, settings.fraction, layers=sorted(set(layers_of_blocks)))
    log(
        f"training data: {len(data)} sequences, {data.answer_tokens} answer tokens "
        f"({settings.fraction:g} of the set)"
    )
    # What a budget curve needs of a run that may never finish (training/budget.py): its kind, batch and data.
    run_info = {
        "kind": settings.kind,
        "batch_size": settings.batch_size,
        "steps": settings.steps,
        "sequences": len(data),
        "answer_tokens": data.answer_tokens,
        **device_record(device),
    }
    (out / RUN).write_text(json.dumps(run_info, indent=2) + "\n")
    draft: GlideDraft | EagleDraft
    if eagle:
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
        batch = to_device(host_batch, device)
        if isinstance(draft, EagleDraft):
            loss, metrics = eagle_step_loss(
                draft,
                batch,
                settings.unroll_steps,
                settings.step_decay,
                settings.kd_weight,
                settings.ce_weight,
                settings.bf16,
                settings.feature_noise,
                (settings.seed, state["step"]),
            )
        else:
            loss, metrics = step_loss(draft, batch, settings)
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
            _log_record(
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
            plot(out)
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            save_checkpoint(out / CHECKPOINTS, draft, optimizer, state)
    if isinstance(draft, EagleDraft):
        save_eagle(draft.eval(), out, dtype=torch.bfloat16)
    else:
        save_glide(draft.eval(), out, dtype=torch.bfloat16)
    summary = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        **device_record(device),
        "sequences": len(data),
        "answer_tokens": data.answer_tokens,
        "seconds_last_run": round(time.monotonic() - started, 1),
        "size_bytes": (out / "model.safetensors").stat().st_size,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    plot(out)
    return out


def _eval_record(out: Path, step: int, agreement: Any, log: Callable[[str], None]) -> None:
    _log_record(
        out,
        {"step": step, "eval": agreement.to_json()},
        f"eval step {step}: held-out agreement {agreement.overall:.3f}, "
        f"first token {agreement.by_lag[0]:.3f}, "
        f"chain of 4 accepts {agreement.chain_accepted(4):.2f}",
        log,
    )


def _log_record(out: Path, record: dict[str, Any], message: str, log: Callable[[str], None]) -> None:
    """Says `message` and appends `record` to the run's training log (one JSON object a line)."""
    log(message)
    with open(out / LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def plot(out: Path) -> None:
    """training.png: loss, training agreement and held-out agreement over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (out / LOG).read_text().splitlines() if line.strip()]
    train_r = [r for r in records if "loss" in r]
    eval_r = [r for r in records if "eval" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    if train_r:
        a.plot([r["step"] for r in train_r], [r["loss"] for r in train_r], label="loss")
        a.plot([r["step"] for r in train_r], [r["kl"] for r in train_r], label="KL top-k")
        a.plot([r["step"] for r in train_r], [r["ce"] for r in train_r], label="CE argmax")
        a.legend()
        b.plot(
            [r["step"] for r in train_r],
            [r["accuracy"] for r in train_r],
            label="training batches",
            alpha=0.6,
        )
    a.set(xlabel="step", title="distillation loss")
    if eval_r:
        steps = [r["step"] for r in eval_r]
        b.plot(steps, [r["eval"]["overall"] for r in eval_r], "o-", label="held out (eval-draft)")
        b.plot(steps, [r["eval"]["by_lag"][0] for r in eval_r], "s--", label="held out, first token")
    b.set(xlabel="step", ylabel="top-1 agreement", title="agreement with the target")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=110)
    plt.close(fig)


# --- the data-scaling curve -----------------------------------------------------------------------------


def scaling_curve(runs: Sequence[Path], out_png: Path) -> list[dict[str, Any]]:
    """Final held-out agreement of runs that differ only in `fraction`: a table (returned) and a plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for run in runs:
        summary = json.loads((Path(run) / SUMMARY).read_text())
        records = [json.loads(x) for x in (Path(run) / LOG).read_text().splitlines() if x.strip()]
        final = [r for r in records if "eval" in r][-1]
        points.append(
            {
                "run": Path(run).name,
                "fraction": summary["settings"]["fraction"],
                "answer_tokens": summary["answer_tokens"],
                "steps": final["step"],
                "agreement": final["eval"]["overall"],
                "first_token": final["eval"]["by_lag"][0],
                "chain_of_4": final["eval"]["chain_accepted"]["4"],
            }
        )
    points.sort(key=lambda p: p["answer_tokens"])
    fig, ax = plt.subplots(figsize=(6, 3.8))
    tokens = [p["answer_tokens"] for p in points]
    ax.plot(tokens, [p["first_token"] for p in points], "s-", label="first draft token")
    ax.plot(tokens, [p["agreement"] for p in points], "o-", label="all 5 draft tokens")
    ax.set(xscale="log", xlabel="self-distillation answer tokens (log)", ylabel="held-out agreement")
    ax.set_title(f"data scaling at a fixed budget ({points[0]['steps']} steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return points


# --- command line ------------------------------------------------------------------------------------------


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
    from specserve.models import load_causal_lm, resolve_model_dir
    from specserve.settings import EngineSettings

    usable_device(args.device)  # before a model is looked for, loaded or written
    engine = EngineSettings.from_env(model_dir=args.model_dir)
    model_dir = resolve_model_dir(engine.model_dir, engine.cache_dir, engine.model)
    if args.command == "features":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        # auto: oneDNN-packed weights on a CPU, cuBLAS on CUDA (nothing here reads a weight directly).
        # float32, with torch's default of no TF32 on CUDA: the features are the float32 target's.
        target = load_causal_lm(model_dir, device=args.device, linear_kernel="auto")
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


if __name__ == "__main__":
    main()
