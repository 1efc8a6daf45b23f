"""The in-process engine: the served models (runtime/models.py) plus the speculative loop, running any
registered method on a prompt, alone or many continuously batched."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationConfig

from specserve.catalog import HF_PROMPT_LOOKUP_TOKENS, Method
from specserve.core.finish import FinishChecker
from specserve.core.grammar import ConstrainedDrafter
from specserve.core.loop import speculative_generate
from specserve.core.prompt_indexes import PROMPT_INDEX_TOKENS, PromptIndexCache
from specserve.core.protocols import KnowsPrompt, RoundOutcome
from specserve.core.request import GenerationRequest, RequestLimits
from specserve.errors import InvalidArgument
from specserve.methods import method_spec
from specserve.models import encode_chat, load_causal_lm
from specserve.results import GenerationResult, GenerationStats
from specserve.runtime.batching import Scheduler
from specserve.runtime.early_exit import early_exit_draft
from specserve.runtime.kernels import LinearKernel
from specserve.runtime.models import ServedModels
from specserve.runtime.prefix_cache import PrefixCache, block_tokens_for
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK, LocalVerifier
from specserve.settings import EngineSettings

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM


def request_limits(settings: EngineSettings, vocab_size: int | None = None) -> RequestLimits:
    """The bounds an in-process engine with these settings puts on requests (every method of the
    catalog; no log-probabilities)."""
    return RequestLimits(
        max_new_tokens_limit=settings.max_new_tokens_limit,
        max_prompt_tokens=settings.prompt_limit,
        max_context=settings.context_limit,
        max_tree_nodes=settings.max_tree_nodes,
        vocab_size=vocab_size,
    )


class Engine(ServedModels):
    @property
    def methods(self) -> list[str]:
        return [m.value for m in Method]

    # transformers' baselines (the `hf` methods): in process only, never in a service.
    @functools.cached_property
    def reference_model(self) -> CausalLM:
        """The `hf` method's model: transformers as users run it, with torch's own linear kernel. The
        served target when that is what it runs; otherwise a second, plain copy, loaded on first use."""
        if self.linear_kernel is LinearKernel.NATIVE and self.settings.resolved_weights == "dense":
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
    def prefix_cache(self) -> PrefixCache | None:
        """Prompt K/V kept across this engine's requests (one tenant: the process's user); None = off."""
        budget = self.settings.prefix_cache_bytes
        return self._new_prefix_cache(budget)

    @functools.cached_property
    def prompt_index_cache(self) -> PromptIndexCache | None:
        """The suffix indexes of this engine's prompts, kept with its prefix cache (on or off with it)."""
        return PromptIndexCache(PROMPT_INDEX_TOKENS) if self.settings.prefix_cache_bytes else None

    def reset_prefix_cache(self, budget_bytes: int) -> None:
        """An empty prefix cache of `budget_bytes` from now on (0 = off), and prompt index cache with it:
        the bench measures with the cache on and off, each from cold, on one engine."""
        self.prefix_cache = self._new_prefix_cache(budget_bytes)
        self.prompt_index_cache = PromptIndexCache(PROMPT_INDEX_TOKENS) if budget_bytes else None

    def _new_prefix_cache(self, budget_bytes: int) -> PrefixCache | None:
        if not budget_bytes:
            return None
        return PrefixCache(budget_bytes, block_tokens_for(self.target_runner, DEFAULT_PREFILL_CHUNK))

    @property
    def limits(self) -> RequestLimits:
        return request_limits(self.settings, self.target_model.config.vocab_size)

    def encode_prompt(self, prompt: str) -> list[int]:
        """The user message through the chat template (its length is checked with the request)."""
        if not prompt or not prompt.strip():
            raise InvalidArgument("the prompt is empty")
        return encode_chat(self.tokenizer, prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def generate(
        self,
        prompt: str,
        request: GenerationRequest,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """One chat prompt; `request` says how (GenerationRequest.build)."""
        return self.generate_ids(self.encode_prompt(prompt), request, on_tokens)

    def generate_ids(
        self,
        prompt_ids: list[int],
        request: GenerationRequest,
        on_tokens: Callable[[list[int]], None] | None = None,
        batch_sessions: Callable[[], int] | None = None,
        on_round: Callable[[RoundOutcome], None] | None = None,
    ) -> GenerationResult:
        """One tokenized prompt. `batch_sessions`: the sessions sharing its forwards (generate_many's
        scheduler), which cost-sized drafters size each round by; None = alone. `on_round`: each
        round's outcome (diagnostics)."""
        limits = self.limits
        request = request.validate(limits, prompt_ids).with_seed()
        assert request.seed is not None
        spec = method_spec(request.method)
        capacity = limits.capacity(len(prompt_ids), request.stopping.max_new_tokens)
        finish = FinishChecker.for_request(request.stopping, self.eos_token_ids, self.decode)
        if spec.uses_hf_generate:
            stats = self._hf_generate(prompt_ids, request, finish, on_tokens)
        else:
            # A guide through the constraint for each role: the verifier's masks the target, the loop's
            # shapes drafts, the drafter's masks its own logits as it drafts.
            guide = self.guide(request.constraint, len(prompt_ids))
            verifier = LocalVerifier(
                self.target_runner,
                capacity,
                sampling=request.sampling,
                prefix_cache=self.prefix_cache,
                guide=guide,
            )
            grammar = self.guide(request.constraint, len(prompt_ids))
            drafter = spec.make_drafter(self, capacity, verifier.cache, request.sampling)
            if isinstance(drafter, KnowsPrompt):
                drafter.know_prompt(len(prompt_ids))
            drafter_grammar = self.guide(request.constraint, len(prompt_ids))
            if drafter_grammar is not None and isinstance(drafter, ConstrainedDrafter):
                drafter.constrain(drafter_grammar)
            try:
                stats = speculative_generate(
                    prompt_ids,
                    verifier,
                    drafter,
                    request.seed,
                    finish,
                    on_tokens,
                    on_round=on_round,
                    batch_sessions=batch_sessions,
                    grammar=grammar,
                )
                stats.num_cached_tokens = verifier.cached_tokens
            finally:
                verifier.release()
                if drafter is not None:
                    drafter.release()
        assert finish.reason is not None
        return GenerationResult(list(finish.generated), finish.final_text(), finish.reason, stats)

    def generate_many(
        self,
        prompt_ids: Sequence[list[int]],
        request: GenerationRequest,
        on_tokens: Sequence[Callable[[list[int]], None] | None] | None = None,
        max_tokens_per_forward: int = 1024,
        max_concurrent: int | None = None,
        on_round: Callable[[RoundOutcome], None] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt at once, continuously batched: each session runs its own loop, and
        every round's forwards of all sessions (target and draft) run as one forward per model.
        `max_concurrent` caps the sessions running at once: the rest wait in order, and each starts as
        soon as a running one finishes (None: all start together).

        Each result equals what `generate_ids` gives for that prompt alone (token for token under
        greedy decoding in float32; with a seed, the same tokens at any temperature).
        """
        callbacks = list(on_tokens) if on_tokens is not None else [None] * len(prompt_ids)
        scheduler = Scheduler(max_tokens_per_forward)
        jobs = [
            functools.partial(self.generate_ids, list(ids), request, callback, scheduler.sessions, on_round)
            for ids, callback in zip(prompt_ids, callbacks, strict=True)
        ]
        self.last_batch_stats = scheduler.stats
        # Held around all sessions: a mode entered and left by interleaved jobs would flip under them.
        return scheduler.run_all(jobs, thread_context=torch.inference_mode(), max_live=max_concurrent)

    def _hf_generate(
        self,
        prompt_ids: list[int],
        request: GenerationRequest,
        finish: FinishChecker,
        on_tokens: Callable[[list[int]], None] | None,
    ) -> GenerationStats:
        params = request.sampling
        sampling = not params.greedy
        config = GenerationConfig(
            max_new_tokens=request.stopping.max_new_tokens,
            do_sample=sampling,
            temperature=params.temperature if sampling else None,
            top_k=params.top_k if sampling else None,
            top_p=params.top_p if sampling else None,
            eos_token_id=sorted(finish.eos_token_ids) or None,
            pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        )
        if request.method == Method.HF_PLD:
            config.prompt_lookup_num_tokens = HF_PROMPT_LOOKUP_TOKENS
        # transformers' default schedule for its assistant (None: plain decoding)
        assistant = self.assistant_model if request.method == Method.HF_ASSISTED else None
        input_ids = torch.tensor([prompt_ids], device=self.target_runner.device)
        start = time.perf_counter()
        if sampling:
            assert request.seed is not None  # generate_ids fixed it
            torch.manual_seed(request.seed)
        model = cast(Any, self.reference_model)
        # transformers fills an unset eos from the model's own generation config; ignore_eos (an empty
        # eos set) must not stop at it, so the model's is cleared for this call.
        model_eos = model.generation_config.eos_token_id
        if not finish.eos_token_ids:
            model.generation_config.eos_token_id = None
        try:
            with torch.inference_mode():
                # Any: some transformers releases type generate's `self` as a Protocol no model meets.
                output = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    generation_config=config,
                    assistant_model=assistant,
                )
        finally:
            model.generation_config.eos_token_id = model_eos
        elapsed = time.perf_counter() - start
        new_tokens = output[0, len(prompt_ids) :].tolist()
        kept = finish.extend(new_tokens)
        if on_tokens is not None and kept:
            on_tokens(kept)
        return GenerationStats(
            num_target_forwards=len(new_tokens),
            num_generated_tokens=len(kept),
            elapsed_s=elapsed,
            verify_s=elapsed,
        )
