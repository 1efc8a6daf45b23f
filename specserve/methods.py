"""Draft methods: a string enum whose values are the CLI names, plus a registry with one signature.

Each entry says how to build the drafter for one sequence (None = plain decoding on our engine) and
whether the method is lossless. `hf` is the only entry that bypasses our loop: it is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from specserve.core.cape import CapeSettings
from specserve.core.protocols import Drafter
from specserve.errors import InvalidArgument
from specserve.glide.drafter import GlideDrafter
from specserve.runtime.drafter import DraftShape, ModelDrafter

if TYPE_CHECKING:
    from specserve.engine import Engine
    from specserve.runtime.target import LocalVerifier


class Method(StrEnum):
    TARGET = "target"  # the target alone on our engine: the speedup baseline
    HF = "hf"  # transformers `generate`: the reference implementation
    VANILLA = "vanilla"  # a separate small causal LM drafting a chain
    VANILLA_TREE = "vanilla-tree"  # the same draft, top-2 leaves at the first two depths
    GLIDE = "glide"  # a GliDe draft reading the target's KV cache, chain of 4
    GLIDE_CAPE = "glide-cape"  # the same draft, CaPE: top-k leaves by the draft's confidence


# (engine, capacity of the sequence's caches, the sequence's verifier) -> its drafter, or None.
# The verifier is there for drafters that read the target's KV cache (GliDe).
DrafterFactory = Callable[["Engine", int, "LocalVerifier"], Drafter | None]


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    description: str
    make_drafter: DrafterFactory
    lossless: bool = True
    uses_hf_generate: bool = False


def _no_drafter(engine: Engine, capacity: int, verifier: LocalVerifier) -> None:
    return None


def _vanilla(shape: DraftShape) -> DrafterFactory:
    def make(engine: Engine, capacity: int, verifier: LocalVerifier) -> Drafter:
        trained = engine.vanilla_glide_draft  # one layer, no cross-attention: reads no target KV
        if trained is not None:
            return GlideDrafter(trained, verifier.cache, capacity, shape)
        return ModelDrafter(engine.vanilla_draft_runner, capacity, shape)

    return make


def _glide(shape: DraftShape, cape: bool) -> DrafterFactory:
    def make(engine: Engine, capacity: int, verifier: LocalVerifier) -> Drafter:
        settings = CapeSettings(max_tree_nodes=engine.settings.max_tree_nodes) if cape else None
        return GlideDrafter(engine.glide_draft, verifier.cache, capacity, shape, settings)

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
        MethodSpec(
            Method.GLIDE,
            "GliDe draft glimpsing the target's KV cache, chain of 4",
            _glide(DraftShape(depth=4), cape=False),
        ),
        MethodSpec(
            Method.GLIDE_CAPE,
            "GliDe draft, depth 4, CaPE top-k leaves by confidence (<= max_tree_nodes nodes)",
            _glide(DraftShape(depth=4), cape=True),
        ),
    )
}


def method_spec(name: str) -> MethodSpec:
    try:
        return METHODS[Method(name)]
    except ValueError:
        known = ", ".join(m.value for m in Method)
        raise InvalidArgument(f"unknown method {name!r}; known methods: {known}") from None
