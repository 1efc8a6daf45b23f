"""A draft made of the target's first k layers (plus its final norm and LM head), sharing weights.

Used as the default `vanilla` draft until a trained draft exists; it costs no extra memory.
"""

from __future__ import annotations

import copy

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
    draft = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    kept = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers
    }
    # assign=True shares the target's tensors instead of copying them.
    draft.load_state_dict(kept, strict=True, assign=True)
    draft.to(device=next(target.parameters()).device, dtype=next(target.parameters()).dtype)
    return draft.eval().requires_grad_(False)
