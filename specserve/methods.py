"""Draft methods: a string enum whose values are the CLI names, plus a registry with one signature.

Each entry says how to build the drafter for one sequence (None = plain decoding on our engine) and
whether the method is lossless. `hf` is the only entry that bypasses our loop: it is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from specserve.core.protocols import Drafter
from specserve.errors import InvalidArgument
from specserve.runtime.drafter import DraftShape, ModelDrafter

if TYPE_CHECKING:
    from specserve.engine import Engine


class Method(StrEnum):
    TARGET = "target"  # the target alone on our engine: the speedup baseline
    HF = "hf"  # transformers `generate`: the reference implementation
    VANILLA = "vanilla"  # a separate small causal LM drafting a chain
    VANILLA_TREE = "vanilla-tree"  # the same draft, top-2 leaves at the first two depths


# (engine, capacity of the sequence's caches) -> the drafter of one sequence, or None.
DrafterFactory = Callable[["Engine", int], Drafter | None]


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    description: str
    make_drafter: DrafterFactory
    lossless: bool = True
    uses_hf_generate: bool = False


def _no_drafter(engine: Engine, capacity: int) -> None:
    return None


def _vanilla(shape: DraftShape) -> DrafterFactory:
    def make(engine: Engine, capacity: int) -> Drafter:
        return ModelDrafter(engine.vanilla_draft_runner, capacity, shape)

    return make


METHODS: dict[Method, MethodSpec] = {
    spec.method: spec
    for spec in (
        MethodSpec(Method.TARGET, "target alone, plain decoding on the specserve engine", _no_drafter),
        MethodSpec(Method.HF, "transformers generate (reference)", _no_drafter, uses_hf_generate=True),
        MethodSpec(Method.VANILLA, "separate draft model, chain of 4", _vanilla(DraftShape(depth=4))),
        MethodSpec(
            Method.VANILLA_TREE,
            "separate draft model, chain of 4 with top-2 leaves at depths 1-2",
            _vanilla(DraftShape(depth=4, widths=(2, 2))),
        ),
    )
}


def method_spec(name: str) -> MethodSpec:
    try:
        return METHODS[Method(name)]
    except ValueError:
        known = ", ".join(m.value for m in Method)
        raise InvalidArgument(f"unknown method {name!r}; known methods: {known}") from None
