"""Both roles in one process: the target's runtime and a draft runtime over the loaded target, whose drafts
borrow its tensors (no second copy) and whose rounds are sized by its own verify curve. The in-process
engine (the CLI, the bench, most tests) builds on it; the services build one role each
(runtime/target_runtime.py, runtime/draft_runtime.py)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from specserve.core.cost import GLIDE_DRAFT, CostModel
from specserve.core.prompt_indexes import TenantPrompts
from specserve.core.suffix_drafter import WorthPriors
from specserve.drafts import DraftKind
from specserve.errors import NotFound
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.runtime.target_runtime import TargetRuntime
from specserve.settings import EngineSettings
from specserve.text_codec import TokenizerCodec

logger = logging.getLogger(__name__)

# Every draft a whole calibration records, GliDe's first (a record's draft_step_s).
CALIBRATED_DRAFTS = (GLIDE_DRAFT, DraftKind.EAGLE.value, DraftKind.VANILLA.value)


class ServedModels(TargetRuntime):
    def __init__(self, settings: EngineSettings | None = None) -> None:
        super().__init__(settings)
        # The drafts keep their own prompt K/V in the engine's prefix cache, when it has one (Engine).
        self.drafts = DraftRuntime(
            self.settings,
            lambda: self.target_model,
            lambda: self.verify_points,
            lambda: getattr(self, "prefix_cache", None),
        )

    def __getattr__(self, name: str) -> Any:
        """The drafts, as the method factories read them (specserve.methods.DraftSources): the draft
        runtime's, over this target."""
        if name == "drafts":  # not set yet: no draft runtime to ask
            raise AttributeError(name)
        return getattr(self.drafts, name)

    def cost_model_for(self, kind: str | None) -> CostModel:
        return self.drafts.cost_model_for(kind)

    def prompt_indexes(self) -> TenantPrompts | None:
        """The suffix indexes of this process's earlier prompts (one tenant: its user), when the engine
        keeps them (Engine.prompt_index_cache)."""
        cache = getattr(self, "prompt_index_cache", None)
        return None if cache is None else TenantPrompts(cache, "")

    @functools.cached_property
    def codec(self) -> TokenizerCodec:
        return TokenizerCodec(self.tokenizer.backend_tokenizer)

    def text_codec(self) -> TokenizerCodec | None:
        """The target's tokenizer, for suffix candidates matched on characters (None for a model without
        one, which cannot be constrained either)."""
        try:
            return self.codec
        except NotFound:
            return None

    @functools.cached_property
    def _worth_priors(self) -> WorthPriors:
        return WorthPriors()

    def worth_priors(self) -> WorthPriors:
        """What model drafts earned in this engine's earlier sessions (one tenant: its user)."""
        return self._worth_priors

    @functools.cached_property
    def cost_model(self) -> CostModel:
        """The whole cost model on this host: the verify curve with every draft's costs (GliDe's as the
        main draft step, the others in other_drafts), each loaded or measured once."""
        glide, *others = CALIBRATED_DRAFTS
        cost = self.drafts.cost_model_for(glide)
        steps = tuple(
            (kind, c.step_s, c.overhead_s) for kind in others for c in [self.drafts.draft_cost(kind)]
        )
        return CostModel(cost.verify_points, cost.draft_step_s, cost.draft_overhead_s, steps)

    def calibrate(self, repeats: int = 3) -> CostModel:
        """Measures this host's whole cost model afresh: the target's verify curve and every draft's step."""
        points = self.measure_verify_points(repeats)
        costs = {kind: self.drafts.measure_draft_cost(kind, repeats) for kind in CALIBRATED_DRAFTS}
        glide = costs.pop(GLIDE_DRAFT)
        others = tuple((kind, c.step_s, c.overhead_s) for kind, c in costs.items())
        return CostModel(points, glide.step_s, glide.overhead_s, others)
