"""A draft made of the target's first k layers (plus its final norm and LM head), sharing weights.

Used as the default `vanilla` draft until a trained draft exists; it costs no extra memory.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from specserve.errors import InvalidArgument


def early_exit_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise InvalidArgument(f"draft_layers must be in [1, {total - 1}], got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):  # a skeleton only: every module below is the target's own
        draft = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    # The target's modules themselves, not their state dict: whatever kernel they run on (packed
    # weights have no state-dict entry, runtime/kernels.py) the draft runs on too, at no memory cost.
    inner, source = draft.model, target.model
    inner.embed_tokens, inner.norm, inner.rotary_emb = source.embed_tokens, source.norm, source.rotary_emb
    inner.layers = nn.ModuleList(source.layers[:num_layers])
    draft.lm_head = target.lm_head
    leftover = [name for name, tensor in draft.state_dict().items() if tensor.is_meta]
    if leftover:
        raise InvalidArgument(
            f"early-exit draft: {target.config.model_type} has parts not shared: {leftover}"
        )
    draft.generation_config = target.generation_config
    return draft.eval().requires_grad_(False)
