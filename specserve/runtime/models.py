"""The models one process serves, loaded once and lazily: the target (its tokenizer, runner and linear
kernel), the drafts of every method, the separate draft model, transformers' reference copies, and the cost
policy's calibration. The in-process engine and the target and draft services all build on it."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from specserve.core.cape import CapeSettings
from specserve.core.cost import CostModel, default_calibration_name
from specserve.core.protocols import DraftTree
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.eagle.config import EagleConfig
from specserve.eagle.drafter import EagleDrafter
from specserve.eagle.model import EagleDraft, build_eagle, load_eagle
from specserve.errors import InvalidArgument
from specserve.glide.drafter import GlideDrafter, TargetKVSource
from specserve.glide.model import GlideDraft, build_glide, load_glide
from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.models.install import as_shipped_dir, profile_dir
from specserve.models.profiles import ModelProfile, model_profile
from specserve.runtime.draft_head import cut_head
from specserve.runtime.drafter import DraftShape, ModelDrafter, PolicyDrafter
from specserve.runtime.early_exit import early_exit_draft
from specserve.runtime.kernels import LinearKernel, apply_linear_kernel, resolve_kernel, speed_dtype
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier
from specserve.settings import EngineSettings

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM

logger = logging.getLogger(__name__)

DraftT = TypeVar("DraftT", GlideDraft, EagleDraft)


class ServedModels:
    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings.from_env()
        if self.settings.num_threads > 0:
            torch.set_num_threads(self.settings.num_threads)
        if self.settings.dtype != "float32":
            # Measured (docs/benchmarks.md, bfloat16): in bf16 greedy output left the target's own decoding
            # after 5-112 tokens on most prompts, because a forward over a tree rounds differently from a
            # forward over one token. The distribution is still the target's, up to that rounding.
            logger.warning(
                "dtype %s: speculative output equals the target's own decoding only up to rounding; "
                "use float32 where greedy output must match token for token",
                self.settings.dtype,
            )

    # Models load lazily so that `specserve generate --method target` never loads a draft.
    @functools.cached_property
    def profile(self) -> ModelProfile:
        return model_profile(self.settings.model)

    @functools.cached_property
    def model_dir(self):
        return resolve_model_dir(self.settings.model_dir, self.settings.cache_dir, self.settings.model)

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
        so float32 on a CPU without a bf16 kernel: `speed_dtype`), else the target's."""
        if self.settings.draft_dtype is not None:
            return self.settings.draft_dtype
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

    @functools.cached_property
    def target_vocab_size(self) -> int:
        """From the target's config.json: a draft service checks its draft against it without loading
        the target's weights."""
        return int(json.loads((Path(self.model_dir) / "config.json").read_text())["vocab_size"])

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.model_dir)

    @functools.cached_property
    def as_shipped_dir(self) -> Path | None:
        """The target file's quantized weights when `weights` is as-shipped: the profile's (built once
        from its file), or a --model-dir's own; None for dense weights."""
        if self.settings.weights != "as-shipped":
            return None
        if self.settings.model_dir is not None:
            return Path(self.model_dir)
        return as_shipped_dir(self.profile, self.settings.cache_dir)

    @property
    def _draft_as_shipped_dir(self) -> Path | None:
        """The profile's own draft model's file weights when the target runs on its file's weights too."""
        own = self._profiles_own_draft and self.profile.draft is not None
        if self.settings.weights != "as-shipped" or not own or self.profile.draft is None:
            return None
        return as_shipped_dir(model_profile(self.profile.draft), self.settings.cache_dir)

    @functools.cached_property
    def target_model(self) -> CausalLM:
        return load_causal_lm(
            self.model_dir,
            self.settings.device,
            self.settings.dtype,
            self.settings.linear_kernel,
            as_shipped=self.as_shipped_dir,
        )

    @property
    def weights_label(self) -> str:
        """What the target's linear layers run on, for file names and records: the linear kernel, or
        `int4` for weights as shipped."""
        return "int4" if self.settings.weights == "as-shipped" else self.linear_kernel.value

    @functools.cached_property
    def linear_kernel(self) -> LinearKernel:
        """The kernel the served models' linear layers run on (recorded by calibration and the bench);
        decided by the settings alone, so naming a calibration file loads no model."""
        return resolve_kernel(
            self.settings.linear_kernel, self.settings.device, getattr(torch, self.settings.dtype)
        )

    @functools.cached_property
    def reference_model(self) -> CausalLM:
        """The `hf` method's model: transformers as users run it, with torch's own linear kernel. The
        served target when that is what it runs; otherwise a second, plain copy, loaded on first use."""
        if self.linear_kernel is LinearKernel.NATIVE and self.settings.weights == "dense":
            return self.target_model
        return load_causal_lm(self.model_dir, self.settings.device, self.settings.dtype)

    @functools.cached_property
    def assistant_model(self) -> CausalLM:
        """The `hf-assisted` method's `assistant_model`, run by transformers as users run it (torch's own
        linear kernel): the separate draft model of the vanilla methods, else the reference model's first
        `draft_layers` layers (transformers cannot run a trained one-block draft)."""
        if self.draft_model_dir is None:
            return cast("CausalLM", early_exit_draft(self.reference_model, self.settings.draft_layers))
        return load_causal_lm(self.draft_model_dir, self.settings.device, self.draft_dtype)

    @functools.cached_property
    def target_runner(self) -> ModelRunner:
        return ModelRunner(self.target_model, label="target")

    @functools.cached_property
    def vanilla_glide_draft(self) -> GlideDraft | None:
        """The trained one-layer draft without cross-attention, if there is one for this target."""
        if self.draft_model_dir is not None:
            return None  # a separate causal-LM draft wins
        directory = self.settings.vanilla_dir or self._shipped(DraftKind.VANILLA)
        return None if directory is None else self._for_serving(load_glide(directory, self.target_model))

    @functools.cached_property
    def vanilla_draft_runner(self) -> ModelRunner:
        if self.draft_model_dir is None:
            draft = early_exit_draft(self.target_model, self.settings.draft_layers)
        else:
            draft = load_causal_lm(
                self.draft_model_dir,
                self.settings.device,
                self.draft_dtype,
                self.settings.linear_kernel,
                as_shipped=self._draft_as_shipped_dir,
            )
        if draft.config.vocab_size != self.target_vocab_size:
            raise InvalidArgument("the draft's vocabulary differs from the target's")
        if self.draft_head_rows and self.draft_model_dir is not None:
            cut_head(draft, self.draft_head_rows, self.tokenizer.all_special_ids, self.settings.linear_kernel)
        return ModelRunner(draft, label="draft")

    @functools.cached_property
    def glide_draft(self) -> GlideDraft:
        directory = self.settings.glide_dir or self._shipped(DraftKind.GLIDE)
        if directory is not None:
            return self._for_serving(load_glide(directory, self.target_model))
        logger.warning(
            "no trained GliDe draft for this target: the draft is randomly initialised (seed 0), so output "
            "stays exact but few drafts are accepted; train one with `specserve train-draft` and set "
            "SPECSERVE_GLIDE_DIR"
        )
        return self._for_serving(build_glide(self.target_model, seed=0, share_target_embeddings=True))

    @property
    def eagle_dir(self) -> Path | None:
        """This target's hidden-state draft: the settings', else the shipped one, else None."""
        return self.settings.eagle_dir or self._shipped(DraftKind.EAGLE)

    @functools.cached_property
    def eagle_feature_layers(self) -> tuple[int, ...]:
        """What a session whose draft reads hidden states keeps: the layers of this target's hidden-state
        draft (read from its config, no weights loaded: the target service feeds a draft it never
        loads); () = the final hidden state."""
        directory = self.eagle_dir
        if directory is None:
            return ()
        return EagleConfig.load(Path(directory) / "config.json").feature_layers

    @functools.cached_property
    def eagle_draft(self) -> EagleDraft:
        directory = self.eagle_dir
        if directory is not None:
            return self._for_serving(load_eagle(directory, self.target_model))
        logger.warning(
            "no trained hidden-state draft for this target: the draft is randomly initialised (seed 0), so "
            "output stays exact but few drafts are accepted; train one with `python -m "
            "specserve.training.distill train --kind eagle` and set SPECSERVE_EAGLE_DIR"
        )
        return self._for_serving(build_eagle(self.target_model, seed=0))

    def _for_serving(self, draft: DraftT) -> DraftT:
        """A draft on the same linear kernel as the target (it serves; it no longer trains)."""
        draft.requires_grad_(False)
        apply_linear_kernel(draft, self.settings.linear_kernel)
        return draft

    @property
    def calibration_path(self) -> Path:
        return self.settings.calibration_path or self.settings.cache_dir / default_calibration_name(
            Path(self.model_dir).name, self.settings.device, self.settings.dtype, self.weights_label
        )

    @functools.cached_property
    def cost_model(self) -> CostModel:
        """The cost policy's costs for this machine: loaded, or measured once and saved (~30 s on 2 cores)."""
        from specserve.runtime.calibrate import load_calibration, save_calibration

        path = self.calibration_path
        if path.is_file():
            return load_calibration(path)

        logger.warning("no cost calibration at %s: measuring this machine's costs once", path)
        cost = self.calibrate()
        save_calibration(cost, path, self.calibration_about())
        return cost

    def calibrate(self, repeats: int = 3) -> CostModel:
        """Measures this engine's target verify curve and its drafts' step costs (GliDe, hidden-state)."""
        from specserve.runtime.calibrate import PROMPT_TOKENS, measure_batch_verify_s, measure_verify_s

        runner = self.target_runner
        verify_points = measure_verify_s(runner, repeats=repeats)
        verify_points += measure_batch_verify_s(runner, repeats=repeats)
        prompt = [i % runner.vocab_size for i in range(10, 10 + PROMPT_TOKENS)]
        capacity = PROMPT_TOKENS + 32
        draft_step_s, draft_overhead_s = self._draft_costs(
            prompt, repeats, lambda cache, shape: GlideDrafter(self.glide_draft, cache, capacity, shape)
        )
        eagle_step_s, eagle_overhead_s = self._draft_costs(
            prompt, repeats, lambda cache, shape: EagleDrafter(self.eagle_draft, cache, capacity, shape)
        )
        vanilla_step_s, vanilla_overhead_s = self._draft_costs(
            prompt, repeats, lambda cache, shape: self.vanilla_drafter(cache, capacity, shape)
        )
        others = (("eagle", eagle_step_s, eagle_overhead_s), ("vanilla", vanilla_step_s, vanilla_overhead_s))
        cost = CostModel(verify_points, draft_step_s, draft_overhead_s, others)
        logger.info(
            "calibrated: verify %s s, GliDe draft step %.4f s (overhead %.4f s), hidden-state draft step "
            "%.4f s (overhead %.4f s), vanilla draft step %.4f s (overhead %.4f s)",
            dict(verify_points),
            draft_step_s,
            draft_overhead_s,
            eagle_step_s,
            eagle_overhead_s,
            vanilla_step_s,
            vanilla_overhead_s,
        )
        return cost

    def vanilla_drafter(
        self,
        target_kv: TargetKVSource,
        capacity: int,
        shape: DraftShape,
        cape: CapeSettings | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> GlideDrafter | ModelDrafter:
        """The vanilla methods' drafter: the trained block without cross-attention (it reads no target
        K/V), else the separate causal-LM draft."""
        trained = self.vanilla_glide_draft
        if trained is not None:
            return GlideDrafter(trained, target_kv, capacity, shape, cape, sampling)
        return ModelDrafter(self.vanilla_draft_runner, capacity, shape, sampling, cape)

    def _draft_costs(
        self,
        prompt: list[int],
        repeats: int,
        make_drafter: Callable[[PositionalKVCache, DraftShape], PolicyDrafter],
    ) -> tuple[float, float]:
        """A draft's step and fixed costs over a prefilled prompt (runtime/calibrate.py)."""
        from specserve.runtime.calibrate import PROMPT_TOKENS, measure_draft_costs

        verifier = LocalVerifier(self.target_runner, PROMPT_TOKENS + 32)
        drafters: dict[int, PolicyDrafter] = {}  # one per depth, kept: its cache holds the prompt
        root: list[int] = []

        def propose(depth: int) -> DraftTree:
            if depth not in drafters:
                drafters[depth] = make_drafter(verifier.cache, DraftShape(depth))
            if not root:  # after the first drafter: one that reads hidden states asks before the prefill
                root.append(verifier.prefill(prompt, round_seed=0))  # greedy
            return drafters[depth].propose([*prompt, root[0]], round_seed=0)

        try:
            return measure_draft_costs(propose, repeats=repeats)
        finally:
            verifier.release()

    def runtime_info(self) -> dict[str, str]:
        """The linear kernel and forward the specserve methods run on (benchmarks record it)."""
        return {
            "linear_kernel": self.linear_kernel.value,
            "weights": self.settings.weights,
            "forward": "lean" if self.target_runner.native is not None else "transformers",
        }

    def calibration_about(self) -> dict:
        """What a calibration was measured on, saved beside it."""
        return {
            "model": str(self.model_dir),
            "device": self.settings.device,
            "dtype": self.settings.dtype,
            **self.runtime_info(),
        }

    def _shipped(self, kind: DraftKind) -> Path | None:
        """A shipped draft was trained for its profile's own checkpoint, not for a --model-dir."""
        return shipped_draft_dir(kind, self.settings.model) if self.settings.model_dir is None else None

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = self.target_model.generation_config.eos_token_id
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if i is not None)
