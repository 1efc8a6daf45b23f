"""Run every method on every prompt, interleaved, and aggregate speed and acceptance.

Aggregates are ratios of totals (total tokens / total seconds), not means of per-prompt ratios: a
mean of ratios over-weights short generations, whose timing is the noisiest.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from specserve.bench.machine import machine_info
from specserve.bench.prompts import Prompt
from specserve.bench.remote import REMOTE_PREFIX
from specserve.catalog import method_info
from specserve.core.request import GenerationRequest
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.method_axes import SYNTAX
from specserve.models.profiles import DEFAULT_PROFILE, model_profile
from specserve.results import GenerationResult, OnTokens
from specserve.runtime.target_runtime import settle_heap
from specserve.settings import EngineSettings

TARGET = "target"  # plain decoding with the target model: the baseline every speedup is against
WARMUP_TOKENS = 8


class EngineLike(Protocol):
    """The part of specserve.engine.Engine the harness uses."""

    @property
    def methods(self) -> list[str]: ...

    def generate(
        self, prompt: str, request: GenerationRequest, on_tokens: OnTokens | None = None
    ) -> GenerationResult: ...


@dataclass
class _Totals:
    """Sums over prompts; every reported number is derived from these."""

    num_prompts: int = 0
    num_generated_tokens: int = 0
    num_target_forwards: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    elapsed_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # prefill included
    wall_s: float = 0.0  # measured around generate(); elapsed_s is the engine's own timing
    num_cached_tokens: int = 0  # prompt tokens served by a prefix cache (the method table starts cold)
    identical_to_target: int = 0

    def add(self, result: GenerationResult, wall_s: float) -> None:
        s = result.stats
        self.num_prompts += 1
        self.num_generated_tokens += s.num_generated_tokens
        self.num_target_forwards += s.num_target_forwards
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        self.elapsed_s += s.elapsed_s
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.wall_s += wall_s
        self.num_cached_tokens += s.num_cached_tokens

    @property
    def num_rounds(self) -> int:
        """Speculation rounds: target forwards after each prompt's prefill."""
        return max(self.num_target_forwards - self.num_prompts, 0)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self, target_tokens_per_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens_per_s": self.tokens_per_s,
            "speedup_vs_target": (
                self.tokens_per_s / target_tokens_per_s if target_tokens_per_s > 0 else None
            ),
            # Same conventions as GenerationStats: 1.0 for plain decoding, None when nothing drafted.
            "mean_accepted_length": (
                self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0
            ),
            "acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
            ),
            # Where a round's time goes; the prefill's share of verify_s is small at 128+ new tokens.
            "draft_ms_per_round": _per(1000 * self.draft_s, self.num_rounds),
            "verify_ms_per_round": _per(1000 * self.verify_s, self.num_target_forwards),
            "draft_tokens_per_round": _per(self.num_draft_tokens, self.num_rounds),
        }
        out.update(asdict(self))
        return out


@dataclass
class _MethodRun:
    totals: _Totals = field(default_factory=_Totals)
    per_category: dict[str, _Totals] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)


def resolve_methods(requested: Sequence[str], available: Sequence[str]) -> tuple[list[str], bool]:
    """Deduplicated methods to run, with the baseline prepended if missing; raises on unknown names. A
    method may be named by its axes (`vanilla+chain-2+gated+suffix`, specserve/method_axes.py) where the
    engine runs the catalog's methods: axes that have a catalog name run under it, axes that cannot run
    together raise why."""
    names, unknown = [], []
    for name in (m.strip() for m in requested):
        if name in available:
            names.append(name)
        elif "+" in name and TARGET in available:
            names.append(method_info(name).name)
        elif name:
            unknown.append(name)
    if unknown:
        raise InvalidArgument(
            f"unknown method(s) {', '.join(unknown)}; available: {', '.join(available)}; or a method's axes, "
            f"{SYNTAX}"
        )
    methods = list(dict.fromkeys(names))
    added = TARGET not in methods
    if added:
        methods.insert(0, TARGET)
    return methods, added


def run_bench(
    engine: EngineLike,
    prompts: Sequence[Prompt],
    methods: Sequence[str],
    request: GenerationRequest,
    progress: bool = True,
    *,
    settings: EngineSettings | None = None,
    prompts_file: Path | str | None = None,
    limit: int | None = None,
    constrain: bool = True,
    settle: bool = False,
) -> dict[str, Any]:
    """Benchmark `methods` (plus the `target` baseline) on `prompts`; returns the JSON-able result.
    Every method runs `request` with its own name in `request.method`, and with the prompt's schema as
    its constraint when the workload gives one and `constrain` is on.

    `settings`, `prompts_file` and `limit` are only recorded in the result's config/machine. settle: after
    the warm-up, move the process's objects out of the garbage collector's reach, as a serving process
    does (`settle_heap`; for a process whose models stay, as the CLI's).
    """
    if not prompts:
        raise InvalidArgument("no prompts to benchmark")
    run_methods, target_added = resolve_methods(methods, engine.methods)

    # Warm-up: first calls pay for lazy model loading, allocator growth and kernel selection.
    stopping = request.stopping
    warmup = replace(
        request, stopping=replace(stopping, max_new_tokens=min(WARMUP_TOKENS, stopping.max_new_tokens))
    )
    if constrain and prompts[0].constraint is not None:
        warmup = replace(warmup, constraint=prompts[0].constraint)
    for method in run_methods:
        engine.generate(prompts[0].text, replace(warmup, method=method))
    if settle:
        settle_heap()
    machine = machine_info(settings)  # after warm-up, so torch's thread count is the one used
    runtime = getattr(engine, "runtime_info", None)
    if callable(runtime):  # which kernel and forward the specserve methods ran on (`hf` runs transformers')
        machine.update(runtime())

    runs = {m: _MethodRun() for m in run_methods}
    bar = tqdm(total=len(prompts), desc="bench", unit="prompt", file=sys.stderr, disable=not progress)
    try:
        for index, prompt in enumerate(prompts):
            # Interleaved: every method runs on this prompt before the next one starts, so drift in
            # the machine (thermal throttling, other load) hits all methods alike; and in a rotating
            # order, so no method always follows the same one. In a fixed order beside transformers
            # and llama.cpp, two methods with the same rounds measured 1.66 and 1.43 steps a round.
            # A workload's schema is the prompt's constraint (unless the request drops them all).
            constrained = replace(request, constraint=prompt.constraint) if constrain else request
            results = {
                m: _timed_generate(engine, prompt, replace(constrained, method=m))
                for m in rotated(run_methods, index)
            }
            target_ids = results[TARGET][0].token_ids
            for method, (result, wall_s) in results.items():
                _record(runs[method], prompt, result, wall_s, result.token_ids == target_ids)
            # Postfix first, without its own redraw: update() then redraws once with both.
            bar.set_postfix_str(
                " | ".join(f"{m} {r.totals.tokens_per_s:.1f} tok/s" for m, r in runs.items()), refresh=False
            )
            bar.update(1)
    finally:
        bar.close()

    return {
        "methods": _summarize(runs),
        "config": _config(
            run_methods, list(methods), target_added, request, settings, prompts_file, limit, len(prompts)
        ),
        "machine": machine,
    }


def forget_prompts(engine: object) -> None:
    """An empty prefix cache of the same budget: every method prefills each prompt itself, as `target`
    (the first to run it) and the peers do. Without this, a method after `target` found the prompt's
    K/V cached and skipped its prefill. A remote engine's services keep their own caches."""
    reset = getattr(engine, "reset_prefix_cache", None)
    settings = getattr(engine, "settings", None)
    if callable(reset) and settings is not None:
        reset(settings.prefix_cache_bytes)


def rotated(methods: Sequence[str], index: int) -> list[str]:
    """The order in which prompt `index` runs `methods`: each prompt starts one method further on."""
    shift = index % len(methods) if methods else 0
    return [*methods[shift:], *methods[:shift]]


def _timed_generate(
    engine: EngineLike, prompt: Prompt, request: GenerationRequest
) -> tuple[GenerationResult, float]:
    forget_prompts(engine)
    start = time.perf_counter()
    result = engine.generate(prompt.text, request)
    elapsed = time.perf_counter() - start
    # In process nothing may come from a cache (remote methods keep their services' caches, documented):
    # an engine wrapped so that `forget_prompts` cannot reach its cache would compare unequal methods.
    if result.stats.num_cached_tokens and not request.method.startswith(REMOTE_PREFIX):
        raise FailedPrecondition(
            f"{request.method} took {result.stats.num_cached_tokens} prompt tokens from a prefix cache the "
            "bench did not empty: the methods would not be compared on equal terms"
        )
    return result, elapsed


def _record(run: _MethodRun, prompt: Prompt, result: GenerationResult, wall_s: float, same: bool) -> None:
    for totals in (run.totals, run.per_category.setdefault(prompt.category, _Totals())):
        totals.add(result, wall_s)
        totals.identical_to_target += int(same)
    run.outputs.append(
        {
            "question_id": prompt.question_id,
            "category": prompt.category,
            "token_ids": list(result.token_ids),
            "text": result.text,
            "finish_reason": str(result.finish_reason),
            "stats": result.stats.to_dict(),
            "wall_s": wall_s,
        }
    )


def _per(amount: float, count: int) -> float | None:
    return amount / count if count else None


def _summarize(runs: dict[str, _MethodRun]) -> dict[str, Any]:
    target = runs[TARGET]
    # One plain decode step of the target on this machine, this run: the unit of cost below.
    target_step_ms = _per(1000 * target.totals.verify_s, target.totals.num_target_forwards)
    out: dict[str, Any] = {}
    for method, run in runs.items():
        entry = run.totals.summary(target.totals.tokens_per_s)
        if target_step_ms:
            verify = entry["verify_ms_per_round"]
            draft = entry["draft_ms_per_round"]
            entry["verify_cost_vs_target_step"] = verify / target_step_ms if verify is not None else None
            entry["draft_cost_vs_target_step"] = draft / target_step_ms if draft is not None else None
        entry["per_category"] = {
            # Per-category speedups compare against the target on the same category's prompts.
            cat: totals.summary(target.per_category[cat].tokens_per_s)
            for cat, totals in run.per_category.items()
        }
        entry["outputs"] = run.outputs
        out[method] = entry
    return out


def _config(
    methods: list[str],
    requested: list[str],
    target_added: bool,
    request: GenerationRequest,
    settings: EngineSettings | None,
    prompts_file: Path | str | None,
    limit: int | None,
    num_prompts: int,
) -> dict[str, Any]:
    model_dir = settings.model_dir if settings else None
    return {
        "methods": methods,
        "requested_methods": requested,
        "target_auto_added": target_added,
        "notes": [f"'{TARGET}' added as the baseline (not requested)"] if target_added else [],
        "max_new_tokens": request.stopping.max_new_tokens,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "top_k": request.sampling.top_k,
        "seed": request.seed,
        "stop": list(request.stopping.stop),
        "ignore_eos": request.stopping.ignore_eos,
        "allow_lossy": request.allow_lossy,
        "limit": limit,
        "num_prompts": num_prompts,
        "prompts_file": portable_path(prompts_file) if prompts_file is not None else None,
        "model": Path(model_dir).name if model_dir else _profile_model_name(settings),
        "model_dir": portable_path(model_dir) if model_dir else None,
        "settings": _jsonable(asdict(settings)) if settings else None,
        "warmup_tokens": WARMUP_TOKENS,
        "order": "interleaved: all methods on each prompt before the next prompt, each prompt starting one "
        "method further on",
    }


def _profile_model_name(settings: EngineSettings | None) -> str:
    """The checkpoint's name when no --model-dir is set: the profile's (the default without settings)."""
    return model_profile(settings.model if settings else DEFAULT_PROFILE).cache_name


def portable_path(path: Path | str) -> str:
    """A path as a result file records it: inside an installed package relative to site-packages,
    inside this package's own tree (a checkout) relative to that tree, under the home directory as ~/...,
    so results name no one machine's layout."""
    text = str(path)
    marker = "site-packages/"
    if marker in text:
        return text.split(marker, 1)[1]
    tree = str(Path(__file__).resolve().parents[2])  # holds specserve/
    if text.startswith(tree + "/"):
        return text[len(tree) + 1 :]
    home = str(Path.home())
    if text == home or text.startswith(home + "/"):
        return "~" + text[len(home) :]
    return text


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: portable_path(v) if isinstance(v, Path) else v for k, v in d.items()}
