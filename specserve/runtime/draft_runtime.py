"""A draft's runtime: the drafts of every method, loaded lazily and only when a method asks for them, their
own measured step costs, and the few target tensors they share.

A draft replica builds one over the target's checkpoint (`TargetShare`: config, embedding, head, final
norm; no decoder layer) and sizes its trees from the serving target's published verify curve plus its
own draft step (`for_target`). In process the engine builds one over the loaded target (shared tensors,
no second copy) and its own verify curve.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from specserve.core.cape import CapeSettings
from specserve.core.cost import (
    GLIDE_DRAFT,
    CostModel,
    DraftCost,
    VerifyPoints,
    draft_costs_from_json,
    draft_costs_to_json,
)
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.drafts import DraftKind
from specserve.eagle.drafter import EagleDrafter
from specserve.eagle.model import EagleDraft, build_eagle, load_eagle
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.glide.drafter import GlideDrafter, TargetKVSource
from specserve.glide.model import GlideDraft, build_glide, load_glide
from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.models.install import as_shipped_dir, profile_dir
from specserve.models.profiles import model_profile
from specserve.runtime.batching import unbatched
from specserve.runtime.draft_head import cut_head
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.early_exit import early_exit_draft
from specserve.runtime.kernels import apply_linear_kernel, speed_dtype
from specserve.runtime.measuring import measuring_alone
from specserve.runtime.prefix_cache import DraftPrefix, PrefixCache
from specserve.runtime.quantized_drafts import apply_rounded, rounded_store
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target_runtime import RoleRuntime, calibration_file, int4_kernel, shipped_for
from specserve.settings import EngineSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DraftT = TypeVar("DraftT", GlideDraft, EagleDraft)


class DraftRuntime(RoleRuntime):
    """target: what the drafts borrow of the target (the loaded target in process; None = read from its
    checkpoint on first use). verify_points: the target's verify curve (in process, the engine's own;
    None = only `for_target` gives costs). prefix_cache: where a draft model keeps its own prompt K/V
    across requests (in process, the engine's prefix cache; None = nowhere)."""

    def __init__(
        self,
        settings: EngineSettings | None = None,
        target: Callable[[], nn.Module] | None = None,
        verify_points: Callable[[], VerifyPoints] | None = None,
        prefix_cache: Callable[[], PrefixCache | None] | None = None,
    ) -> None:
        super().__init__(settings)
        self._target = target
        self._verify_points = verify_points
        self._prefix_cache = prefix_cache or (lambda: None)
        self._draft_costs: dict[str, DraftCost] = {}

    @functools.cached_property
    def target(self) -> nn.Module:
        if self._target is not None:
            return self._target()
        from specserve.models.gguf_quant import STORE_FILE
        from specserve.runtime.target_share import read_target_share

        store = None if self.as_shipped_dir is None else self.as_shipped_dir / STORE_FILE
        dtype = getattr(torch, self.settings.dtype)
        return read_target_share(self.model_dir, self.settings.device, dtype, store)

    @functools.cached_property
    def target_config(self) -> Any:
        """The target's Hugging Face config (no weights loaded)."""
        if self._target is not None:
            return self.target.config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir, local_files_only=True)

    @functools.cached_property
    def special_token_ids(self) -> list[int]:
        """Ids a reduced draft head always keeps (runtime/draft_head.py)."""
        return list(load_tokenizer(self.model_dir).all_special_ids)

    # --- the separate draft model and the vanilla methods ------------------------------------------

    @functools.cached_property
    def draft_model_dir(self) -> Path | None:
        """The separate draft model of the vanilla methods: --draft-dir, else the profile's draft profile
        when the target is the profile's own checkpoint; None when there is none."""
        if self.settings.draft_dir is not None:
            return resolve_model_dir(self.settings.draft_dir, self.settings.cache_dir)
        if self.settings.model_dir is None and self.profile.draft is not None:
            return profile_dir(model_profile(self.profile.draft), self.settings.cache_dir)
        return None

    @property
    def draft_dtype(self) -> str:
        """The separate draft model's dtype: set, else the profile's for its own draft (a choice for speed,
        so float32 on a CPU without a bf16 kernel: `speed_dtype`), else the target's. On its file's own
        weights and the CPU's kernels the profile's draft runs in float32, the profile's choice aside:
        those products read float32 rows whatever the dtype, and its layers run compiled only in float32
        (the 0.5B's step took 46 ms in bfloat16, docs/benchmarks.md)."""
        if self.settings.draft_dtype is not None:
            return self.settings.draft_dtype
        if self._draft_as_shipped_dir_name is not None and int4_kernel(self.settings) == "int8-dot":
            return "float32"
        chosen = self._profiles_own_draft and self.profile.draft_dtype
        return speed_dtype(chosen, self.settings.device) if chosen else self.settings.dtype

    @property
    def draft_head_rows(self) -> int:
        """Rows of the separate draft's LM head (runtime/draft_head.py); 0 = its whole head."""
        if self.settings.draft_head_rows is not None:
            return self.settings.draft_head_rows
        return (self._profiles_own_draft and self.profile.draft_head_rows) or 0

    @property
    def _profiles_own_draft(self) -> bool:
        """The separate draft is the profile's (neither --draft-dir nor --model-dir chose another), so the
        profile's settings for it apply."""
        return self.settings.draft_dir is None and self.settings.model_dir is None

    @property
    def _draft_as_shipped_dir_name(self) -> str | None:
        """The profile whose file's weights the draft model runs (the profile's own draft, when the target
        runs its file's weights too), None otherwise; nothing is built or read."""
        own = self._profiles_own_draft and self.profile.draft is not None
        if self.settings.resolved_weights != "as-shipped" or not own:
            return None
        return self.profile.draft

    @property
    def _draft_as_shipped_dir(self) -> Path | None:
        """The profile's own draft model's file weights when the target runs on its file's weights too."""
        name = self._draft_as_shipped_dir_name
        return None if name is None else as_shipped_dir(model_profile(name), self.settings.cache_dir)

    @functools.cached_property
    def vanilla_glide_draft(self) -> GlideDraft | None:
        """The trained one-layer draft without cross-attention, if there is one for this target."""
        if self.draft_model_dir is not None:
            return None  # a separate causal-LM draft wins
        directory = self.settings.vanilla_dir or shipped_for(self.settings, DraftKind.VANILLA)
        return None if directory is None else self._for_serving(load_glide(directory, self.target))

    @functools.cached_property
    def vanilla_draft_runner(self) -> ModelRunner:
        if self.draft_model_dir is None:
            draft = self._early_exit_draft()
        else:
            # its 4-bit rounding (from its float weights, kept in the cache), else its file's or dense
            rounded = self.settings.resolved_draft_weights == "int4"
            draft = load_causal_lm(
                self.draft_model_dir,
                self.settings.device,
                "float32" if rounded else self.draft_dtype,
                self.settings.linear_kernel,
                as_shipped=(
                    rounded_store(self.draft_model_dir, "int4", self.settings.cache_dir)
                    if rounded
                    else self._draft_as_shipped_dir
                ),
                int4_kernel=self.settings.int4_kernel,
            )
        if draft.config.vocab_size != self.target_vocab_size:
            raise InvalidArgument("the draft's vocabulary differs from the target's")
        if self.draft_head_rows and self.draft_model_dir is not None:
            cut_head(draft, self.draft_head_rows, self.special_token_ids, self.settings.linear_kernel)
        return ModelRunner(draft, label="draft")

    def _early_exit_draft(self) -> PreTrainedModel:
        """The target's first `draft_layers` layers: the loaded target's own modules in process, else just
        those layers read from its checkpoint."""
        layers = self.settings.draft_layers
        if hasattr(getattr(self.target, "model", None), "layers"):
            return early_exit_draft(self.target, layers)  # type: ignore[arg-type]  # a loaded causal LM
        total = self.target_config.num_hidden_layers
        if not 1 <= layers < total:
            raise InvalidArgument(f"draft_layers must be in [1, {total - 1}], got {layers}")
        return load_causal_lm(
            self.model_dir,
            self.settings.device,
            self.settings.dtype,
            self.settings.linear_kernel,
            num_layers=layers,
        )

    def vanilla_drafter(
        self,
        target_kv: TargetKVSource,
        capacity: int,
        shape: DraftShape,
        cape: CapeSettings | None = None,
        sampling: SamplingParams = GREEDY,
        prefix: DraftPrefix | None = None,
    ) -> GlideDrafter | ModelDrafter:
        """The vanilla methods' drafter: the trained block without cross-attention (it reads no target
        K/V), else the separate causal-LM draft. prefix: where it keeps its prompt K/V across requests
        (`draft_prefix`; none while its costs are measured: a cached prefix would time less than a step)."""
        trained = self.vanilla_glide_draft
        if trained is not None:
            return GlideDrafter(trained, target_kv, capacity, shape, cape, sampling, prefix)
        return ModelDrafter(self.vanilla_draft_runner, capacity, shape, sampling, cape, prefix)

    def draft_prefix(self, draft: str) -> DraftPrefix | None:
        """Where `draft` keeps its own prompt K/V across requests: in process the engine's prefix cache
        (one tenant, the process's user). A draft replica has none here: each session's sources
        (`for_target`) scope the replica's cache to the session's tenant and target."""
        return DraftPrefix.of(self._prefix_cache(), draft)

    # --- the drafts that read the target ------------------------------------------------------------

    @functools.cached_property
    def glide_draft(self) -> GlideDraft:
        directory = self.settings.glide_dir or shipped_for(self.settings, DraftKind.GLIDE)
        if directory is not None:
            return self._for_serving(load_glide(directory, self.target))
        logger.warning(
            "no trained GliDe draft for this target: the draft is randomly initialised (seed 0), so output "
            "stays exact but few drafts are accepted; train one with `specserve train-draft` and set "
            "SPECSERVE_GLIDE_DIR"
        )
        return self._for_serving(build_glide(self.target, seed=0, share_target_embeddings=True))

    @property
    def eagle_dir(self) -> Path | None:
        """This target's hidden-state draft: the settings', else the shipped one, else None."""
        return self.settings.eagle_dir or shipped_for(self.settings, DraftKind.EAGLE)

    @functools.cached_property
    def eagle_draft(self) -> EagleDraft:
        directory = self.eagle_dir
        if directory is not None:
            return self._for_serving(load_eagle(directory, self.target))
        logger.warning(
            "no trained hidden-state draft for this target: the draft is randomly initialised (seed 0), so "
            "output stays exact but few drafts are accepted; train one with `python -m "
            "specserve.training.distill train --kind eagle` and set SPECSERVE_EAGLE_DIR"
        )
        return self._for_serving(build_eagle(self.target, seed=0))

    def _for_serving(self, draft: DraftT) -> DraftT:
        """A draft that serves (it no longer trains): on rounded weights where `draft_weights` says so,
        else on the same linear kernel as the target."""
        draft.requires_grad_(False)
        rounded = self.settings.resolved_draft_weights
        if rounded != "dense":
            apply_rounded(draft, rounded)
        else:
            apply_linear_kernel(draft, self.settings.linear_kernel)
        return draft

    # --- costs ---------------------------------------------------------------------------------------

    @property
    def draft_costs_path(self) -> Path:
        """This host's measured draft costs (the target's curve is the target's, in its own file)."""
        return calibration_file(self.settings, self.model_dir, prefix="draft-costs")

    def draft_cost(self, kind: str) -> DraftCost:
        """`kind`'s step and fixed costs on this host: from a whole calibration (`specserve calibrate`)
        or this host's draft costs when recorded, else measured now (that kind's draft only) and added."""
        if kind not in self._draft_costs:
            self._draft_costs[kind] = self._recorded_cost(kind) or self._measure_and_record(kind)
        return self._draft_costs[kind]

    def _recorded_cost(self, kind: str) -> DraftCost | None:
        from specserve.runtime.calibrate import load_record

        for path in (calibration_file(self.settings, self.model_dir), self.draft_costs_path):
            if path.is_file():
                cost = draft_costs_from_json(load_record(path)).get(kind)
                if cost is not None:
                    return cost
        return None

    def _measure_and_record(self, kind: str) -> DraftCost:
        from specserve.runtime.calibrate import load_record, save_record

        with measuring_alone(self.settings.cache_dir):
            recorded_meanwhile = self._recorded_cost(kind)  # by another process of this host
            if recorded_meanwhile is not None:
                return recorded_meanwhile
            logger.warning("no %s draft cost recorded at %s: measuring it once", kind, self.draft_costs_path)
            cost = self.measure_draft_cost(kind)
            path = self.draft_costs_path
            recorded = draft_costs_from_json(load_record(path)) if path.is_file() else {}
            about = {
                "model": Path(self.model_dir).name,
                "device": self.settings.device,
                "dtype": self.settings.dtype,
            }
            save_record(draft_costs_to_json({**recorded, kind: cost}), path, about)
        return cost

    def measure_draft_cost(self, kind: str, repeats: int = 3) -> DraftCost:
        """Times `kind`'s drafter over synthetic target state (runtime/calibrate.py): no target forward."""
        from specserve.runtime.calibrate import PROMPT_TOKENS, measure_draft_cost

        capacity = PROMPT_TOKENS + 32
        makers: dict[str, Callable[[Any, int], Any]] = {
            GLIDE_DRAFT: lambda state, depth: GlideDrafter(
                self.glide_draft, state, capacity, DraftShape(depth)
            ),
            DraftKind.EAGLE.value: lambda state, depth: EagleDrafter(
                self.eagle_draft, state, capacity, DraftShape(depth)
            ),
            DraftKind.VANILLA.value: lambda state, depth: self.vanilla_drafter(
                state, capacity, DraftShape(depth)
            ),
        }
        if kind not in makers:
            raise InvalidArgument(f"no draft kind {kind!r}; known: {', '.join(makers)}")
        dtype = getattr(torch, self.settings.dtype)
        with measuring_alone(self.settings.cache_dir), unbatched():  # as the target's curve
            cost = measure_draft_cost(makers[kind], self.target_config, self.settings.device, dtype, repeats)
        logger.info("calibrated: %s draft step %.4f s (overhead %.4f s)", kind, cost.step_s, cost.overhead_s)
        return cost

    def verify_points(self) -> VerifyPoints:
        if self._verify_points is None:
            raise FailedPrecondition(
                "no target verify curve here: a draft replica takes its target's (for_target)"
            )
        return self._verify_points()

    def cost_model_for(self, kind: str | None) -> CostModel:
        """The costs a `kind` draft's rounds are sized by: the target's verify curve and this host's step
        of that draft; kind None = no draft forward (suffix candidates alone)."""
        return self.for_target(self.verify_points()).cost_model_for(kind)

    def for_target(
        self, verify_points: VerifyPoints, prefix: Callable[[str], DraftPrefix | None] | None = None
    ) -> TargetCosted:
        """These drafts, sized by a serving target's published verify curve; `prefix` gives where each
        draft keeps its prompt K/V for the session (None: nowhere)."""
        return TargetCosted(self, verify_points, prefix)


class TargetCosted:
    """A draft runtime sized by one target's verify curve: what the method factories read
    (specserve.methods.DraftSources) in a draft replica. Everything but the costs is the runtime's own:
    its drafts load once and serve every session, whichever target it verifies on."""

    def __init__(
        self,
        runtime: DraftRuntime,
        verify_points: VerifyPoints,
        prefix: Callable[[str], DraftPrefix | None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.verify_points = verify_points
        self._prefix = prefix

    def draft_prefix(self, draft: str) -> DraftPrefix | None:
        """Where `draft` keeps its own prompt K/V for the session these sources serve (its tenant's
        blocks, on its target): the replica's choice, else nowhere."""
        return None if self._prefix is None else self._prefix(draft)

    def prompt_indexes(self) -> None:
        """None: a draft replica drafts no suffix candidates (the router does, with its own cache)."""
        return None

    def text_codec(self) -> None:
        """None: as for prompt_indexes."""
        return None

    def worth_priors(self) -> None:
        """None: as for prompt_indexes."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)  # the settings and the drafts

    def cost_model_for(self, kind: str | None) -> CostModel:
        step = DraftCost(0.0) if kind is None else self.runtime.draft_cost(kind)
        return step.with_verify(self.verify_points)
