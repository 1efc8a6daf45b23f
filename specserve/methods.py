"""Draft methods: each method's drafter for one sequence (None = plain decoding on our engine), built
from its axes (specserve/method_axes.py) by one builder, `drafter_factory`.

The axes pick one entry of each registry, all of one signature: the draft's spine drafter (SPINE_DRAFTERS),
the tree's drafter (TREE_DRAFTERS), the stop policy's settings (STOP_SETTINGS); suffix candidates are put
in front of the model draft by core/suffix_drafter.py's `suffix_drafter`, the one place that assembles
them (the router calls it too). Names, descriptions and the lossless flag live in specserve.catalog
(torch-free, for the router). A lossy method is exact at T = 0 only; the engine refuses it at T > 0 unless
the request sets allow_lossy. The `hf` methods bypass our loop: they are the references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specserve.catalog import CATALOG, Method, MethodInfo, method_info
from specserve.core.cape import CapeSettings
from specserve.core.cost import CostModel
from specserve.core.prompt_indexes import TenantPrompts
from specserve.core.protocols import Drafter
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stop_names import StopPolicyName
from specserve.core.stopping import StopSettings
from specserve.core.suffix_drafter import WorthBook, WorthPriors, suffix_drafter
from specserve.core.text_suffix import TextCodec
from specserve.drafts import DraftKind
from specserve.eagle.drafter import EagleDrafter, HiddenStateSource
from specserve.eagle.model import EagleDraft
from specserve.glide.drafter import GlideDrafter, TargetKVSource
from specserve.glide.model import GlideDraft
from specserve.method_axes import Draft, MethodAxes, Tree
from specserve.runtime.drafter import DraftShape
from specserve.runtime.mcsd import McsdShape, MultiCandidateDrafter
from specserve.runtime.prefix_cache import DraftPrefix
from specserve.runtime.runner import ModelRunner
from specserve.runtime.stopper import shipped_decision_model
from specserve.settings import EngineSettings


class DraftSources(Protocol):
    """What the drafter factories read: the loaded drafts and the costs. The engine's ServedModels is one; a
    draft replica passes its DraftRuntime sized by the serving target's costs (`for_target`). This module
    imports neither."""

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
        prefix: DraftPrefix | None = None,
    ) -> Drafter: ...

    @property
    def vanilla_draft_runner(self) -> ModelRunner: ...

    @property
    def eagle_draft(self) -> EagleDraft: ...

    def draft_prefix(self, draft: str) -> DraftPrefix | None:
        """Where `draft` keeps its own prompt K/V across requests (None: nowhere)."""
        ...

    def cost_model_for(self, kind: str | None) -> CostModel:
        """The serving target's verify curve with `kind`'s draft step on the draft's host (None: no draft
        forward)."""
        ...

    def prompt_indexes(self) -> TenantPrompts | None:
        """Where a session's suffix index may start from its tenant's earlier prompts (None: nowhere)."""
        ...

    def text_codec(self) -> TextCodec | None:
        """The serving tokenizer, for suffix candidates matched on characters (None: on token ids only)."""
        ...

    def worth_priors(self) -> WorthPriors | None:
        """What model drafts earned in this process's earlier sessions (None: each session from scratch)."""
        ...


class TargetSource(TargetKVSource, HiddenStateSource, Protocol):
    """What a drafter may read of the target: its committed K/V (GliDe) or final hidden states (eagle).
    In-process it is the verifier's own cache; in the draft service the mirror of the target's feed."""


# (engine, capacity of the sequence's caches, the target's committed state of the sequence, the
# session's sampling) -> its drafter, or None.
DrafterFactory = Callable[[DraftSources, int, TargetSource, SamplingParams], Drafter | None]


@dataclass(frozen=True)
class MethodSpec:
    info: MethodInfo
    make_drafter: DrafterFactory

    @property
    def method(self) -> str:
        return self.info.name

    @property
    def description(self) -> str:
        return self.info.description

    @property
    def lossless(self) -> bool:
        return self.info.lossless

    @property
    def uses_hf_generate(self) -> bool:
        return self.info.uses_hf_generate


def _no_drafter(
    engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
) -> None:
    return None


# -- the draft: how it drafts a spine tree (chains, top-2 leaves, CaPE) ----------------------------------

# (engine, capacity, the target's committed state, sampling, shape, CaPE or None) -> the drafter
SpineFactory = Callable[
    [DraftSources, int, TargetSource, SamplingParams, DraftShape, CapeSettings | None], Drafter
]


def _vanilla(
    engine: DraftSources,
    capacity: int,
    target_kv: TargetSource,
    sampling: SamplingParams,
    shape: DraftShape,
    cape: CapeSettings | None,
) -> Drafter:
    prefix = engine.draft_prefix(DraftKind.VANILLA.value)
    return engine.vanilla_drafter(target_kv, capacity, shape, cape, sampling, prefix)


def _glide(
    engine: DraftSources,
    capacity: int,
    target_kv: TargetSource,
    sampling: SamplingParams,
    shape: DraftShape,
    cape: CapeSettings | None,
) -> Drafter:
    prefix = engine.draft_prefix(DraftKind.GLIDE.value)
    return GlideDrafter(engine.glide_draft, target_kv, capacity, shape, cape, sampling, prefix)


def _eagle(
    engine: DraftSources,
    capacity: int,
    target_kv: TargetSource,
    sampling: SamplingParams,
    shape: DraftShape,
    cape: CapeSettings | None,
) -> Drafter:
    prefix = engine.draft_prefix(DraftKind.EAGLE.value)
    return EagleDrafter(engine.eagle_draft, target_kv, capacity, shape, cape, sampling, prefix)


SPINE_DRAFTERS: dict[Draft, SpineFactory] = {
    Draft.VANILLA: _vanilla,
    Draft.GLIDE: _glide,
    Draft.EAGLE: _eagle,
}


# -- the stop policy's settings ----------------------------------------------------------------------

# (engine, the draft) -> the policy's settings; None = its defaults
StopSettingsFactory = Callable[[DraftSources, Draft], StopSettings | None]


def _defaults(engine: DraftSources, draft: Draft) -> None:
    return None


def _decision(engine: DraftSources, draft: Draft) -> StopSettings:
    """The stopper trained on `draft`'s runs: it predicts acceptance of this draft's tokens."""
    return StopSettings(decision_model=shipped_decision_model(draft.value))


def _gated(engine: DraftSources, draft: Draft) -> StopSettings:
    """The gated chain needs this machine's calibration (with `draft`'s calibrated step) only: it reads
    no per-token predictions."""
    return StopSettings(cost_model=engine.cost_model_for(draft.value))


def _cost(engine: DraftSources, draft: Draft) -> StopSettings:
    """The cost policy needs this machine's calibration (with `draft`'s calibrated step), which only the
    engine knows, and the stopper trained on `draft`'s runs."""
    return StopSettings(
        cost_model=engine.cost_model_for(draft.value),
        decision_model=shipped_decision_model(draft.value),
    )


STOP_SETTINGS: dict[StopPolicyName, StopSettingsFactory] = {
    StopPolicyName.FIXED: _defaults,  # the shape sets the depth
    StopPolicyName.SVIP: _defaults,
    StopPolicyName.ADAEDL: _defaults,
    StopPolicyName.DECISION: _decision,
    StopPolicyName.COST: _cost,
    StopPolicyName.GATED: _gated,
}


# -- the tree ----------------------------------------------------------------------------------------

TOP2_WIDTHS = (2, 2)  # the spine token and the draft's second choice at depths 1 and 2
MCSD_LEVELS = (2, 2)  # sampled candidates per node at the first levels of an MCSD tree; 1 below


def mcsd_levels(depth: int) -> tuple[int, ...]:
    """An MCSD tree's k_config (children per node at each level) of `depth` levels: (2, 2, 1, 1, ...)."""
    return (MCSD_LEVELS + (1,) * depth)[:depth]


# (axes, stop settings, engine, capacity, the target's committed state, sampling) -> the drafter
TreeFactory = Callable[
    [MethodAxes, StopSettings | None, DraftSources, int, TargetSource, SamplingParams], Drafter
]


def _spine_tree(
    axes: MethodAxes,
    stop: StopSettings | None,
    engine: DraftSources,
    capacity: int,
    target_kv: TargetSource,
    sampling: SamplingParams,
) -> Drafter:
    widths = TOP2_WIDTHS if axes.tree is Tree.TOP2 else ()
    shape = DraftShape(depth=axes.depth, widths=widths, stop=axes.stop, stop_settings=stop)
    cape = CapeSettings(max_tree_nodes=engine.settings.max_tree_nodes) if axes.tree is Tree.CAPE else None
    return SPINE_DRAFTERS[axes.draft](engine, capacity, target_kv, sampling, shape, cape)


def _mcsd_tree(
    axes: MethodAxes,
    stop: StopSettings | None,
    engine: DraftSources,
    capacity: int,
    target_kv: TargetSource,
    sampling: SamplingParams,
) -> Drafter:
    # Trees are drafted level by level with tree attention, which the causal-LM runner supports; the
    # draft is the vanilla methods' causal LM (draft_dir, else the target's first layers).
    shape = McsdShape(
        k_config=mcsd_levels(axes.depth),
        stop=axes.stop,
        stop_settings=stop,
        target_roots=axes.tree is Tree.MCSD_TARGET,
    )
    return MultiCandidateDrafter(engine.vanilla_draft_runner, capacity, shape, sampling)


TREE_DRAFTERS: dict[Tree, TreeFactory] = {
    Tree.CHAIN: _spine_tree,
    Tree.TOP2: _spine_tree,
    Tree.CAPE: _spine_tree,
    Tree.MCSD: _mcsd_tree,
    Tree.MCSD_TARGET: _mcsd_tree,
}


# -- the builder -------------------------------------------------------------------------------------


def _model_drafter(axes: MethodAxes) -> DrafterFactory:
    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        stop = STOP_SETTINGS[axes.stop](engine, axes.draft)
        return TREE_DRAFTERS[axes.tree](axes, stop, engine, capacity, target_kv, sampling)

    return make


def _with_suffix(model: DrafterFactory | None, draft: Draft) -> DrafterFactory:
    """Suffix candidates alone, or merged with `model`'s trees, sized by this machine's calibration."""

    def make(
        engine: DraftSources, capacity: int, target_kv: TargetSource, sampling: SamplingParams
    ) -> Drafter:
        inner = model(engine, capacity, target_kv, sampling) if model is not None else None
        priors = engine.worth_priors()
        return suffix_drafter(
            inner,
            engine.settings.max_tree_nodes,
            sampling,
            lambda: engine.cost_model_for(None if draft is Draft.NONE else draft.value),
            prompts=engine.prompt_indexes(),
            codec=engine.text_codec(),
            worth=None if priors is None else WorthBook(priors, draft.value),
        )

    return make


def drafter_factory(axes: MethodAxes | None) -> DrafterFactory:
    """The drafter of a method of these axes (None: transformers' own generate, which drafts nothing here)."""
    if axes is None:
        return _no_drafter
    model = _model_drafter(axes) if axes.drafts else None
    if axes.suffix:
        return _with_suffix(model, axes.draft)
    return model if model is not None else _no_drafter


def method_spec(name: str) -> MethodSpec:
    """The method a request names (a catalog name or axes, specserve.catalog.method_info)."""
    info = method_info(name)
    return MethodSpec(info, drafter_factory(info.axes))


METHODS: dict[Method, MethodSpec] = {method: method_spec(method) for method in CATALOG}
