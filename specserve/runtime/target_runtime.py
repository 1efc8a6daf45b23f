"""The target's runtime: its weights, runner, tokenizer and limits, and its own measured verify cost curve.

What a target replica loads, and all of it: no draft. The curve is the replica's own (one forward over n
tree nodes on this host, model, dtype and kernel), loaded from its calibration file or measured once; the
target service publishes it (ModelInfo.costs) so that drafts and the router size trees from the costs of
the target that verifies them, wherever they run.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.core.constraint import Constraint
from specserve.core.cost import VerifyPoints, default_calibration_name, verify_points_from_json
from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.eagle.config import EagleConfig
from specserve.grammar import GrammarCompiler, Guide
from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.models.install import as_shipped_dir
from specserve.models.profiles import ModelProfile, model_profile
from specserve.runtime.batching import unbatched
from specserve.runtime.int4 import resolve_int4_kernel
from specserve.runtime.kernels import LinearKernel, resolve_kernel
from specserve.runtime.measuring import measuring_alone
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM

logger = logging.getLogger(__name__)


def settle_heap() -> None:
    """Moves every object alive now out of the garbage collector's reach, once a serving process has
    loaded its models: their hundreds of thousands of objects live as long as the process, and each full
    collection walked them all in the middle of a decoding step (measured: a one-token step 9% faster on
    average once frozen). Only where the models stay: a frozen model dropped later is never collected."""
    gc.freeze()


def apply_process_settings(settings: EngineSettings) -> None:
    """What every model process sets once: its torch threads."""
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)


def shipped_for(settings: EngineSettings, kind: DraftKind) -> Path | None:
    """A shipped draft was trained for its profile's own checkpoint, not for a --model-dir."""
    return shipped_draft_dir(kind, settings.model) if settings.model_dir is None else None


def int4_kernel(settings: EngineSettings) -> str | None:
    """The 4-bit kernel of weights as shipped ("int8-dot" or "torch"), None for dense weights."""
    if settings.resolved_weights != "as-shipped":
        return None
    return resolve_int4_kernel(settings.int4_kernel, settings.device)


def weights_label(settings: EngineSettings) -> str:
    """What the target's linear layers run on, for file names and records: the linear kernel, or `int4`
    (torch's 4-bit kernel) / `int8dot-<build>` for weights as shipped, <build> the first 8 digits of the
    CPU kernels' build key: recorded costs follow the kernels, so a changed kernel is timed again instead
    of priced by an older build's record. `-int8drafts` / `-int4drafts` follows when the drafts run on
    rounded weights (their steps, which the records hold too, change with them). Decided by the settings
    and the sources alone, so naming a calibration file loads no model."""
    rounded = settings.resolved_draft_weights
    drafts = "" if rounded == "dense" else f"-{rounded}drafts"
    kernel = int4_kernel(settings)
    if kernel is not None:
        if kernel == "torch":
            return "int4" + drafts
        from specserve.runtime.cpu_kernels import build_key

        return f"int8dot-{(build_key() or 'none')[:8]}{drafts}"
    dense = resolve_kernel(settings.linear_kernel, settings.device, getattr(torch, settings.dtype)).value
    return dense + drafts


# How the recorded costs are timed (runtime/calibrate.py `time_by_size`: each size after its own calls,
# the largest first), named in their files and versions: a record timed the earlier way (sizes going up,
# small ones just after the largest) read the default model's curve flat on an Intel Xeon, and is timed
# again rather than trusted.
MEASURED = "settled"


def calibration_file(settings: EngineSettings, model_dir: Path, prefix: str = "calibration") -> Path:
    """The set calibration file, else `<cache_dir>/<prefix>-<model>-<device>-<dtype>-<kernel>-settled.json`
    (MEASURED)."""
    if prefix == "calibration" and settings.calibration_path is not None:
        return settings.calibration_path
    name = default_calibration_name(
        Path(model_dir).name, settings.device, settings.dtype, f"{weights_label(settings)}-{MEASURED}"
    )
    return settings.cache_dir / name.replace("calibration", prefix, 1)


class RoleRuntime:
    """What each role's runtime shares: the settings (the process's threads set once), the profile, and
    the target's checkpoint directory and vocabulary, none of which loads a weight. Each part loads
    lazily and once: constructing a runtime loads nothing."""

    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings.from_env()
        apply_process_settings(self.settings)

    @functools.cached_property
    def profile(self) -> ModelProfile:
        return model_profile(self.settings.model)

    @functools.cached_property
    def model_dir(self) -> Path:
        """The target's checkpoint (a draft reads its config and the tensors the drafts share)."""
        return resolve_model_dir(self.settings.model_dir, self.settings.cache_dir, self.settings.model)

    @functools.cached_property
    def target_vocab_size(self) -> int:
        """From the target's config.json, without loading its weights."""
        return int(json.loads((Path(self.model_dir) / "config.json").read_text())["vocab_size"])

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Constraints compiled against the target's tokenizer (a draft's vocabulary is the target's); a
        finished language ends at the tokenizer's or the generation config's end of sequence."""
        tokenizer = load_tokenizer(self.model_dir)
        ids = {tokenizer.eos_token_id}
        config = Path(self.model_dir) / "generation_config.json"
        if config.exists():
            configured = json.loads(config.read_text()).get("eos_token_id")
            ids.update(configured if isinstance(configured, list) else [configured])
        return GrammarCompiler(tokenizer.backend_tokenizer.to_str(), {i for i in ids if i is not None})

    def guide(self, constraint: Constraint | None, num_prompt_tokens: int) -> Guide | None:
        """A session's guide through `constraint` (None: unconstrained); InvalidConstraint if it does not
        compile."""
        if constraint is None:
            return None
        return self.grammar_compiler.guide(constraint, num_prompt_tokens, self.settings.max_tree_nodes)

    @functools.cached_property
    def as_shipped_dir(self) -> Path | None:
        """The target file's quantized weights when `weights` is as-shipped: the profile's (built once
        from its file), or a --model-dir's own; None for dense weights. A draft replica reads the
        embedding it shares from there."""
        if self.settings.resolved_weights != "as-shipped":
            return None
        if self.settings.model_dir is not None:
            return Path(self.model_dir)
        return as_shipped_dir(self.profile, self.settings.cache_dir)


class TargetRuntime(RoleRuntime):
    def __init__(self, settings: EngineSettings | None = None) -> None:
        super().__init__(settings)
        if self.settings.dtype != "float32":
            # Measured (docs/benchmarks.md, bfloat16): in bf16 greedy output left the target's own decoding
            # after 5-112 tokens on most prompts, because a forward over a tree rounds differently from a
            # forward over one token. The distribution is still the target's, up to that rounding.
            logger.warning(
                "dtype %s: speculative output equals the target's own decoding only up to rounding; "
                "use float32 where greedy output must match token for token",
                self.settings.dtype,
            )

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.model_dir)

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Constraints compiled against this target's tokenizer; a finished language ends at its eos."""
        return GrammarCompiler(self.tokenizer.backend_tokenizer.to_str(), self.eos_token_ids)

    @functools.cached_property
    def target_model(self) -> CausalLM:
        return load_causal_lm(
            self.model_dir,
            self.settings.device,
            self.settings.dtype,
            self.settings.linear_kernel,
            as_shipped=self.as_shipped_dir,
            int4_kernel=self.settings.int4_kernel,
        )

    @functools.cached_property
    def target_runner(self) -> ModelRunner:
        return ModelRunner(self.target_model, label="target")

    @functools.cached_property
    def linear_kernel(self) -> LinearKernel:
        """The kernel the served models' linear layers run on (recorded by calibration and the bench);
        decided by the settings alone, so naming a calibration file loads no model."""
        return resolve_kernel(
            self.settings.linear_kernel, self.settings.device, getattr(torch, self.settings.dtype)
        )

    @property
    def weights_label(self) -> str:
        return weights_label(self.settings)

    @property
    def eagle_dir(self) -> Path | None:
        """This target's hidden-state draft: the settings', else the shipped one, else None."""
        return self.settings.eagle_dir or shipped_for(self.settings, DraftKind.EAGLE)

    @functools.cached_property
    def eagle_feature_layers(self) -> tuple[int, ...]:
        """What a session whose draft reads hidden states keeps: the layers of this target's hidden-state
        draft (read from its config, no weights loaded: the target feeds a draft it never loads); () =
        the final hidden state."""
        directory = self.eagle_dir
        if directory is None:
            return ()
        return EagleConfig.load(Path(directory) / "config.json").feature_layers

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = self.target_model.generation_config.eos_token_id
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if i is not None)

    # --- costs ------------------------------------------------------------------------------------

    @property
    def calibration_path(self) -> Path:
        return calibration_file(self.settings, self.model_dir)

    @property
    def costs_version(self) -> str:
        """What the verify curve holds for: it changes whenever the model, device, dtype, kernel or way of
        timing does, so a draft that cached a replica's curve knows when to take the new one."""
        settings = self.settings
        return "/".join(
            (Path(self.model_dir).name, settings.device, settings.dtype, self.weights_label, MEASURED)
        )

    @functools.cached_property
    def verify_points(self) -> VerifyPoints:
        """This replica's verify curve, single forwards and batches: loaded, or measured once and saved
        (half a minute for the default model on 2 cores, minutes for a 1.5B one: its progress is logged,
        and a stack waits for a start that keeps logging). A calibration record of a whole cost model
        holds it too."""
        from specserve.runtime.calibrate import load_record, save_record

        path = self.calibration_path
        if path.is_file():
            return verify_points_from_json(load_record(path))
        self.target_runner  # noqa: B018 - loaded before waiting: loading need not wait for a measurement
        with measuring_alone(self.settings.cache_dir):
            if path.is_file():  # another process of this host measured it meanwhile
                return verify_points_from_json(load_record(path))
            logger.warning("no cost calibration at %s: measuring this target's verify costs once", path)
            points = self.measure_verify_points()
            save_record({"verify_s": {str(n): s for n, s in points}}, path, self.calibration_about())
        return points

    def measure_verify_points(self, repeats: int = 3) -> VerifyPoints:
        """This replica's verify curve, measured now, alone among this host's measurements."""
        from specserve.runtime.calibrate import measure_batch_verify_s, measure_verify_s

        runner = self.target_runner
        # unbatched: a session's first round may start it, inside a batch of other sessions
        with measuring_alone(self.settings.cache_dir), unbatched():
            single = measure_verify_s(runner, repeats=repeats)
            points = single + measure_batch_verify_s(runner, repeats=repeats)
        logger.info("calibrated: verify %s s", dict(points))
        return points

    def runtime_info(self) -> dict[str, str]:
        """The kernels and forward the specserve methods run on (benchmarks record it); the 4-bit kernel
        for weights as shipped, "-" for dense ones."""
        return {
            "linear_kernel": self.linear_kernel.value,
            "weights": self.settings.resolved_weights,
            "int4_kernel": int4_kernel(self.settings) or "-",
            "forward": "lean" if self.target_runner.native is not None else "transformers",
        }

    def calibration_about(self) -> dict:
        """What a calibration was measured on, saved beside it (no path of this host: the model's name)."""
        return {
            "model": Path(self.model_dir).name,
            "device": self.settings.device,
            "dtype": self.settings.dtype,
            **self.runtime_info(),
        }
