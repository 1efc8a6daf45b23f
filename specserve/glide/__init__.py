"""GliDe: a draft that glimpses the target's KV cache (Du et al., ICML 2024), with CaPE trees.

config.py: GlideConfig, the whole configuration; model.py: the draft (pure torch), its training mask
and safetensors checkpoints; drafter.py: GlideDrafter, the Drafter that reads the target cache in place.
"""

from specserve.glide.config import GlideConfig
from specserve.glide.drafter import GlideDrafter, TargetKVSource
from specserve.glide.model import (
    GlideDraft,
    blockwise_cross_mask,
    build_glide,
    frequency_ranked_ids,
    load_glide,
    save_glide,
)

__all__ = [
    "GlideConfig",
    "GlideDraft",
    "GlideDrafter",
    "TargetKVSource",
    "blockwise_cross_mask",
    "build_glide",
    "frequency_ranked_ids",
    "load_glide",
    "save_glide",
]
