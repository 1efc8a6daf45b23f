"""Held-out agreement during a run: `eval-draft`'s MT-Bench answers and metric, with the target's features
of those answers computed once and cached beside them."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from specserve.bench.prompts import load_prompts, per_category
from specserve.training.distill.settings import DistillSettings
from specserve.training.eagle import held_out_hidden, score_eagle
from specserve.training.evaluate import held_out_answers, held_out_features, score_draft

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM


def held_out_eval(
    target: CausalLM, tokenizer: Any, settings: DistillSettings, cache_dir: Path, layers: Sequence[int]
):
    """-> a function draft -> Agreement on `eval-draft`'s held-out MT-Bench answers (features cached)."""
    cache, sequences, starts, pad = _answers(target, tokenizer, settings, cache_dir)
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
    cache, sequences, starts, pad = _answers(target, tokenizer, settings, cache_dir)
    kind = "hidden" + "".join(f"-{layer}" for layer in feature_layers)
    features_cache = cache.with_name(cache.stem + f"-features-{kind}.safetensors")
    batches = _cached_features(
        features_cache,
        len(sequences),
        lambda: held_out_hidden(target, sequences, starts, pad, output_layers=feature_layers),
    )
    return lambda draft: score_eagle(draft, batches)


def _answers(
    target: CausalLM, tokenizer: Any, settings: DistillSettings, cache_dir: Path
) -> tuple[Path, list[list[int]], list[int], int]:
    """-> (the answers' cache file, prompt + answer token ids, where each answer starts, the pad id)."""
    prompts = [p.text for p in per_category(load_prompts(), settings.eval_per_category)]
    name = Path(target.config._name_or_path).name or "target"
    cache = cache_dir / f"eval-answers-{name}-{len(prompts)}x{settings.eval_max_new_tokens}.json"
    sequences, starts = held_out_answers(target, tokenizer, prompts, settings.eval_max_new_tokens, cache)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return cache, sequences, starts, pad


def _cached_features(
    path: Path, count: int, compute: Callable[[], list[dict[str, torch.Tensor]]]
) -> list[dict[str, torch.Tensor]]:
    """The held-out batches' target features, computed once (a target forward) and kept as safetensors."""
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
