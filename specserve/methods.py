"""Draft methods: a string enum whose values are the CLI names, plus a registry with one signature.

Each entry says how to build the drafter for one sequence (None = plain decoding on our engine) and
whether the method is lossless. A lossy method (lossless False) is exact at T = 0 only; the engine refuses
it at T > 0 unless the request sets allow_lossy.
`hf` is the only entry that bypasses our loop: it is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specserve.catalog import ADAPTIVE_DEPTH, CATALOG, Method
from specserve.core.cape import CapeSettings
from specserve.core.cost import NOMINAL_CPU_COST, CostModel
from specserve.core.protocols import Drafter
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stopping import StopPolicyName, StopSettings
from specserve.core.suffix_drafter import SuffixDrafter
from specserve.eagle.drafter import EagleDrafter, HiddenStateSource
from specserve.eagle.model import EagleDraft
from specserve.errors import InvalidArgument
from specserve.glide.drafter import GlideDrafter, TargetKVSource
from specserve.glide.model import GlideDraft
from specserve.runtime.batching import other_sessions
from specserve.runtime.drafter import DraftShape
from specserve.runtime.mcsd import McsdShape, MultiCandidateDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.stopper import shipped_decision_model
from specserve.settings import EngineSettings


class DraftSources(Protocol):
    """What the drafter factories read: the loaded drafts and the costs. specserve.runtime.models.ServedModels
    is one (the engine and the draft service pass theirs; this module imports neither)."""

    settings: EngineSettings

    @property
    def glide_draft(self) -> GlideDraft: ...

    def vanilla_drafter(
        self,
        target_kv: TargetKVSource,
        capacity: int,
        shape: DraftShape,
        cape: CapeSettings | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> Drafter: ...

    @property
    def vanilla_draft_runner(self) -> ModelRunner: ...

    @property
    def eagle_draft(self) -> EagleDraft: ...

    def cost_model_for(self, kind: str | None) -> CostModel:
        """The serving target's verify curve with `kind`'s draft step on the draft's host (None: no draft
        forward)."""
        ...


class TargetSource(TargetKVSource, HiddenStateSource, Protocol):
    """What a drafter may read of the target: its committed K/V (GliDe) or final hidden states (eagle).
    In-process it is the verifier's own cache; in the draft service the mirror of the target's feed."""


# (engine, capacity of the sequence's caches, the target's committed state of the sequence, the
# session's sampling) -> its drafter, or None.
DrafterFactory = Callable[[DraftSources, int, TargetSource, SamplingParams], Drafter | None]


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    description: str
    make_drafter: DrafterFactory
    lossless: bool = True
    uses_hf_generate: bool = False


def _no_drafter(
    engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
) -> None:
    return None


def _vanilla(shape: DraftShape, cape: bool = False) -> DrafterFactory:
    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        settings = CapeSettings(max_tree_nodes=engine.settings.max_tree_nodes) if cape else None
        return engine.vanilla_drafter(target_kv, capacity, shape, settings, sampling)

    return make


def _glide(shape: DraftShape, cape: bool) -> DrafterFactory:
    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        settings = CapeSettings(max_tree_nodes=engine.settings.max_tree_nodes) if cape else None
        return GlideDrafter(engine.glide_draft, target_kv, capacity, shape, settings, sampling)

    return make


# Adaptive GliDe + CaPE: the policy decides each round's spine length within ADAPTIVE_DEPTH (catalog.py).


def _glide_cape_stop(stop: StopPolicyName) -> DrafterFactory:
    return _glide(DraftShape(depth=ADAPTIVE_DEPTH, stop=stop), cape=True)


def _eagle(shape: DraftShape, cape: bool) -> DrafterFactory:
    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        settings = CapeSettings(max_tree_nodes=engine.settings.max_tree_nodes) if cape else None
        return EagleDrafter(engine.eagle_draft, target_kv, capacity, shape, settings, sampling)

    return make


def _cape_cost(family: Callable[[DraftShape, bool], DrafterFactory], draft: str) -> DrafterFactory:
    """`family`'s CaPE trees, depth and width by expected tokens per second: the cost policy needs this
    machine's calibration (with `draft`'s calibrated step), which only the engine knows, and the stopper
    trained on `draft`'s runs."""

    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter | None:
        cost_model = engine.cost_model_for(draft)
        settings = StopSettings(
            cost_model=cost_model,
            batch_sessions=other_sessions,
            decision_model=shipped_decision_model(draft),  # predicts acceptance of this draft's tokens
        )
        shape = DraftShape(depth=ADAPTIVE_DEPTH, stop=StopPolicyName.COST, stop_settings=settings)
        return family(shape, True)(engine, capacity, target_kv, sampling)

    return make


_glide_cape_cost = _cape_cost(_glide, "glide")
_eagle_cape_cost = _cape_cost(_eagle, "eagle")
_vanilla_cape_cost = _cape_cost(_vanilla, "vanilla")


def _mcsd(shape: McsdShape) -> DrafterFactory:
    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        # Trees are drafted level by level with tree attention, which the causal-LM runner supports; the
        # draft is the vanilla methods' causal LM (draft_dir, else the target's first layers).
        return MultiCandidateDrafter(engine.vanilla_draft_runner, capacity, shape, sampling)

    return make


def _with_suffix(inner: DrafterFactory | None, draft: str = "glide") -> DrafterFactory:
    """Suffix candidates (core/suffix_drafter.py) alone, or merged with `inner`'s trees."""

    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        model = inner(engine, capacity, target_kv, sampling) if inner is not None else None
        if not sampling.greedy:
            # A sampled session's tree decides its random draws: sized the same wherever it runs (the
            # router has no calibration) and whatever else runs, so a seed gives the same text.
            return SuffixDrafter(model, engine.settings.max_tree_nodes, NOMINAL_CPU_COST)
        cost = engine.cost_model_for(draft if inner is not None else None)
        return SuffixDrafter(model, engine.settings.max_tree_nodes, cost, batch_load=other_sessions)

    return make


# Names, descriptions and lossless flags live in specserve.catalog (torch-free, for the router); this
# registry binds each name to its drafter factory.
_FACTORIES: dict[Method, DrafterFactory] = {
    Method.TARGET: _no_drafter,
    Method.HF: _no_drafter,
    Method.HF_PLD: _no_drafter,
    Method.HF_ASSISTED: _no_drafter,
    Method.VANILLA: _vanilla(DraftShape(depth=4)),
    Method.VANILLA_TREE: _vanilla(DraftShape(depth=4, widths=(2, 2))),
    Method.VANILLA_CAPE_SVIP: _vanilla(DraftShape(depth=ADAPTIVE_DEPTH, stop=StopPolicyName.SVIP), cape=True),
    Method.VANILLA_CAPE_COST: _vanilla_cape_cost,
    Method.VANILLA_CAPE_SUFFIX: _with_suffix(_vanilla_cape_cost, "vanilla"),
    Method.GLIDE: _glide(DraftShape(depth=4), cape=False),
    Method.GLIDE_CAPE: _glide(DraftShape(depth=4), cape=True),
    Method.GLIDE_CAPE_1: _glide(DraftShape(depth=1), cape=True),
    Method.GLIDE_CAPE_2: _glide(DraftShape(depth=2), cape=True),
    Method.GLIDE_CAPE_SVIP: _glide_cape_stop(StopPolicyName.SVIP),
    Method.GLIDE_CAPE_ADAEDL: _glide_cape_stop(StopPolicyName.ADAEDL),
    Method.GLIDE_CAPE_DECISION: _glide_cape_stop(StopPolicyName.DECISION),
    Method.GLIDE_CAPE_COST: _glide_cape_cost,
    Method.MCSD: _mcsd(McsdShape(k_config=(2, 2, 1))),
    Method.MCSD_TARGET_INIT: _mcsd(McsdShape(k_config=(2, 2, 1, 1), target_roots=True)),
    Method.SUFFIX: _with_suffix(None),
    Method.GLIDE_CAPE_SUFFIX: _with_suffix(_glide_cape_cost),
    Method.EAGLE: _eagle(DraftShape(depth=4), cape=False),
    Method.EAGLE_CAPE: _eagle(DraftShape(depth=4), cape=True),
    Method.EAGLE_CAPE_COST: _eagle_cape_cost,
    Method.EAGLE_CAPE_SUFFIX: _with_suffix(_eagle_cape_cost, "eagle"),
}

METHODS: dict[Method, MethodSpec] = {
    method: MethodSpec(
        info.method, info.description, _FACTORIES[method], info.lossless, info.uses_hf_generate
    )
    for method, info in CATALOG.items()
}


def method_spec(name: str) -> MethodSpec:
    try:
        return METHODS[Method(name)]
    except ValueError:
        known = ", ".join(m.value for m in Method)
        raise InvalidArgument(f"unknown method {name!r}; known methods: {known}") from None
