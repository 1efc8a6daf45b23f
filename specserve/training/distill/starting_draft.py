"""The draft a run starts from: a trained one (`--init-from`, its shape kept), or a new one on the target
whose reduced head holds the target's own rows for the training set's most frequent labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.eagle.config import EagleConfig
from specserve.eagle.model import EagleDraft, build_eagle, load_eagle
from specserve.glide.config import spread_target_layers
from specserve.glide.model import GlideDraft, build_glide, frequency_ranked_ids, load_glide
from specserve.training.distill.feature_set import FeatureSet
from specserve.training.distill.settings import DistillSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def block_layers(settings: DistillSettings, num_target_layers: int) -> tuple[int, ...]:
    """The target layer each block of a draft trained from scratch reads."""
    if settings.block_target_layers is not None:
        return settings.block_target_layers
    return spread_target_layers(settings.num_layers, num_target_layers)


def new_draft(settings: DistillSettings, target: PreTrainedModel, data: FeatureSet) -> GlideDraft:
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
