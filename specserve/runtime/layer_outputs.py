"""Reading decoder layers' outputs out of a transformers forward, for a fused hidden-state draft."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def capture_layer_outputs(
    decoder_layers: Sequence[nn.Module], layers: Collection[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """While open, each forward of decoder layer `i` (for i in `layers`) stores its output [..., H], the
    residual stream after that layer, under i in the yielded dict. Hooks rather than
    `output_hidden_states`: what that tuple holds at its last index (normed or not) has differed between
    transformers versions; a layer's own output has not."""
    outputs: dict[int, torch.Tensor] = {}

    def keeper(index: int) -> Callable[..., None]:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            outputs[index] = output[0] if isinstance(output, tuple) else output

        return keep

    handles = [decoder_layers[layer].register_forward_hook(keeper(layer)) for layer in layers]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def side_by_side(outputs: dict[int, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """[..., H] per layer -> [..., k * H], in the order of `layers` (a fused draft's feature)."""
    return torch.cat([outputs[layer] for layer in layers], dim=-1)
