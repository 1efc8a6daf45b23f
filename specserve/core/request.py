"""What a user asks of a generation, validated once: `GenerationRequest.build` (or `validate`).

The CLI, the bench, the engine, the router's gRPC API and its HTTP API all build requests here, so a bad
value gets the same InvalidArgument (the same message) wherever it comes in. Everything downstream takes
the validated request and never checks it again. Torch-free: the router builds requests too.

A request splits as Hugging Face TGI's does: sampling (how a token is chosen; fixed for a whole session,
so the target and draft services are told it once), stopping (when the generation ends), and what
concerns the run as a whole (method, seed, the lossy opt-in, log-probabilities, the constraint its text
must satisfy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specserve.catalog import DEFAULT_METHOD, IN_PROCESS, MethodSupport, method_info
from specserve.core.constraint import Constraint
from specserve.core.rng import fresh_seed
from specserve.core.sampling_params import SamplingParams
from specserve.errors import InvalidArgument
from specserve.method_axes import Tree

# Bounds every request must respect, whoever serves it. The new-token cap is the default of
# EngineSettings.max_new_tokens_limit (SPECSERVE_MAX_NEW_TOKENS_LIMIT), which the services report.
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TEMPERATURE = 100.0  # beyond this every distribution is uniform to float precision anyway
MAX_TOP_K = 2**31 - 1  # the wire's int32
MAX_SEED = 2**63  # seeds are in [0, 2**63): what torch's generators and the wire's uint64 both hold
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


class InvalidField(InvalidArgument):
    """A request field out of its bounds. `field` names it as GenerationRequest.build does (the HTTP
    API reports it as OpenAI's `param`)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class StoppingParams:
    """When a generation ends, besides the model's end-of-sequence tokens (unless ignore_eos)."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    ignore_eos: bool = False


@dataclass(frozen=True)
class RequestLimits:
    """What one deployment accepts: model bounds and the methods it runs. None = not known here (the
    CLI checks a remote request before the router, which knows the model, checks it again)."""

    max_new_tokens_limit: int | None = MAX_NEW_TOKENS_LIMIT
    max_prompt_tokens: int | None = None
    max_context: int | None = None  # prompt + new tokens + one draft tree
    max_tree_nodes: int = 0
    vocab_size: int | None = None
    methods: MethodSupport = IN_PROCESS  # which methods run here (in process: all of them)
    supports_logprobs: bool = False

    def capacity(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """Positions a session's KV caches must hold: the prompt, every new token and one tree."""
        return num_prompt_tokens + max_new_tokens + self.max_tree_nodes + 1


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request. Build it with `build` (or `validate` a changed copy)."""

    method: str = DEFAULT_METHOD
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    # The request seed: every round's seeds derive from it and the position (core/rng.py), so a run is
    # reproducible and resumable. None = a fresh one for each generation (`with_seed`).
    seed: int | None = None
    allow_lossy: bool = False  # opt in to a lossy method (catalog: lossless False) at T > 0
    logprobs: bool = False  # report each token's log-probability under the target
    top_logprobs: int = 0  # ... with this many most likely tokens at its position
    # The language the generated text must belong to (core/constraint.py); None = unconstrained.
    constraint: Constraint | None = None

    @classmethod
    def build(
        cls,
        *,
        method: str = DEFAULT_METHOD,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        seed: int | None = None,
        allow_lossy: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        constraint: Constraint | None = None,
        limits: RequestLimits | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> GenerationRequest:
        """The one way in from user input: every field checked against `limits` (and the prompt's
        length and ids, when given). A method named by its axes gets its catalog name when it has one."""
        request = cls(
            method=str(method),
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
            stopping=StoppingParams(max_new_tokens, tuple(stop), ignore_eos),
            seed=seed,
            allow_lossy=allow_lossy,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            constraint=constraint,
        )
        request = request.validate(limits or RequestLimits(), prompt_ids)
        return replace(request, method=method_info(request.method).name)

    def validate(self, limits: RequestLimits, prompt_ids: Sequence[int] | None = None) -> GenerationRequest:
        """Raises InvalidField naming the first field out of bounds; returns the request unchanged."""
        check_sampling(self.sampling)
        _check_stopping(self.stopping, limits)
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise InvalidField("seed", f"seed must be in [0, 2**63), got {self.seed}")
        self._check_method(limits)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidField(
                "top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs")
        if self.logprobs and not limits.supports_logprobs:
            raise InvalidField("logprobs", "logprobs are not supported by this deployment")
        if self.constraint is not None:
            self._check_constrained()
        if prompt_ids is not None:
            _check_prompt(prompt_ids, self.stopping.max_new_tokens, limits)
        return self

    def _check_method(self, limits: RequestLimits) -> None:
        served = limits.methods.names()
        try:
            info = method_info(self.method, known=served)
        except InvalidArgument as e:
            raise InvalidField("method", str(e)) from None
        if not info.lossless and not self.sampling.greedy and not self.allow_lossy:
            raise InvalidField(
                "method",
                f"method {self.method} is lossy at temperature > 0 (its output does not follow the "
                "target's distribution); set allow_lossy (--allow-lossy) to use it anyway",
            )
        if not limits.methods.runs(info):
            raise InvalidField(
                "method", f"method {self.method!r} is not served here; available: {', '.join(served)}"
            )

    def _check_constrained(self) -> None:
        # A finished language allows only the end of sequence: ignoring it would leave nothing to emit.
        if self.stopping.ignore_eos:
            raise InvalidField("ignore_eos", "ignore_eos cannot be combined with a constraint")
        axes = method_info(self.method).axes
        if axes is None:
            raise InvalidField("method", f"method {self.method} (transformers' generate) takes no constraint")
        if axes.tree is Tree.MCSD_TARGET:
            # Its rounds commit the target's root candidates without one distribution to mask.
            raise InvalidField("method", f"method {self.method} cannot run under a constraint")

    def with_seed(self) -> GenerationRequest:
        """This request with its seed fixed: a fresh one if it had none."""
        return self if self.seed is not None else replace(self, seed=fresh_seed())

    @property
    def num_top_logprobs(self) -> int | None:
        """None without log-probabilities; else how many most likely tokens to report with each."""
        return self.top_logprobs if self.logprobs else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: how sessions keep it (the router's Redis record)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationRequest:
        """What `to_dict` wrote (trusted: it was validated before it was stored)."""
        stopping = dict(data["stopping"])
        return cls(
            method=data["method"],
            sampling=SamplingParams(**data["sampling"]),
            stopping=StoppingParams(**(stopping | {"stop": tuple(stopping["stop"])})),
            seed=data["seed"],
            allow_lossy=data["allow_lossy"],
            logprobs=data["logprobs"],
            top_logprobs=data["top_logprobs"],
            constraint=Constraint.from_dict(data["constraint"]) if data.get("constraint") else None,
        )


def check_sampling(sampling: SamplingParams) -> None:
    """The sampling part of `GenerationRequest.validate`: the target and draft services check what a
    router sends them with it too."""
    if not 0.0 <= sampling.temperature <= MAX_TEMPERATURE:  # False for NaN and inf too
        raise InvalidField(
            "temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {sampling.temperature}"
        )
    if not (math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0):
        raise InvalidField("top_p", f"top_p must be in (0, 1], got {sampling.top_p}")
    if not 0 <= sampling.top_k <= MAX_TOP_K:
        raise InvalidField("top_k", f"top_k must be in [0, {MAX_TOP_K}], got {sampling.top_k}")


def _check_stopping(stopping: StoppingParams, limits: RequestLimits) -> None:
    limit = limits.max_new_tokens_limit
    if stopping.max_new_tokens < 1 or (limit is not None and stopping.max_new_tokens > limit):
        bounds = f"[1, {limit}]" if limit is not None else ">= 1"
        raise InvalidField(
            "max_new_tokens", f"max_new_tokens must be in {bounds}, got {stopping.max_new_tokens}"
        )
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stopping.stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stopping.stop):
        raise InvalidField("stop", f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters")


def _check_prompt(prompt_ids: Sequence[int], max_new_tokens: int, limits: RequestLimits) -> None:
    if not prompt_ids:
        raise InvalidField("prompt", "the prompt is empty")
    if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidField("prompt", f"prompt token ids must be in [0, {limits.vocab_size})")
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise InvalidField(
            "prompt",
            f"the prompt has {len(prompt_ids)} tokens; at most {limits.max_prompt_tokens} allowed",
        )
    context = limits.max_context
    if context is not None and limits.capacity(len(prompt_ids), max_new_tokens) > context:
        raise InvalidField(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
            f"context limit of {context - limits.max_tree_nodes - 1} tokens",
        )
