"""GenerationRequest: every bound refused with an InvalidField that names the field, the serialised form
the router keeps in Redis, and the stop logic every generation shares."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specserve.catalog import Method, MethodSupport
from specserve.core.finish import FinishChecker
from specserve.core.request import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_STRINGS,
    GenerationRequest,
    InvalidField,
    RequestLimits,
    StoppingParams,
)
from specserve.core.sampling_params import SamplingParams
from specserve.errors import InvalidArgument
from specserve.results import FinishReason

LIMITS = RequestLimits(
    max_new_tokens_limit=100,
    max_prompt_tokens=10,
    max_context=50,
    max_tree_nodes=8,
    vocab_size=1000,
    methods=MethodSupport(in_process=False),  # a router's: no transformers runs, no target-seeded roots
    supports_logprobs=True,
)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"temperature": -0.1}, "temperature", "temperature must be in [0, 100], got -0.1"),
        ({"temperature": math.nan}, "temperature", "temperature must be in [0, 100]"),
        ({"temperature": math.inf}, "temperature", "temperature must be in [0, 100]"),
        ({"temperature": 101.0}, "temperature", "temperature must be in [0, 100]"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ({"top_p": math.nan}, "top_p", "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k", "top_k must be in [0, 2147483647], got -1"),
        ({"top_k": 2**31}, "top_k", "top_k must be in [0, 2147483647]"),
        ({"max_new_tokens": 0}, "max_new_tokens", "max_new_tokens must be in [1, 100], got 0"),
        ({"max_new_tokens": 101}, "max_new_tokens", "max_new_tokens must be in [1, 100], got 101"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", "at most 16 stop strings, got 17"),
        ({"stop": [""]}, "stop", "stop strings must have 1..256 characters"),
        ({"stop": ["x" * 257]}, "stop", "stop strings must have 1..256 characters"),
        ({"seed": -1}, "seed", "seed must be in [0, 2**63), got -1"),
        ({"seed": 2**63}, "seed", "seed must be in [0, 2**63)"),
        ({"method": "nope"}, "method", "unknown method 'nope'; known methods: target, vanilla, vanilla-tree"),
        (
            {"method": "hf"},
            "method",
            "method 'hf' is not served here; available: target, vanilla, vanilla-tree",
        ),
        (
            {"method": "glide+mcsd"},
            "method",
            "method 'glide+mcsd': mcsd trees are drafted by the vanilla draft",
        ),
        ({"method": "vanilla+mcsd-target-3"}, "method", "method 'vanilla+mcsd-target-3' is not served here"),
        (
            {"method": "mcsd-target-init", "temperature": 0.5},
            "method",
            "method mcsd-target-init is lossy at temperature > 0",
        ),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
        ({"prompt_ids": []}, "prompt", "the prompt is empty"),
        ({"prompt_ids": [1, 1000]}, "prompt", "prompt token ids must be in [0, 1000)"),
        ({"prompt_ids": [1] * 11}, "prompt", "the prompt has 11 tokens; at most 10 allowed"),
        (
            {"prompt_ids": [1] * 10, "max_new_tokens": 32},
            "max_new_tokens",
            "prompt (10 tokens) + max_new_tokens (32) exceed the context limit of 41 tokens",
        ),
    ],
)
def test_every_bound_is_refused_with_the_field_it_names(fields, field, message) -> None:
    with pytest.raises(InvalidField) as raised:
        GenerationRequest.build(**({"method": "target", "max_new_tokens": 8} | fields), limits=LIMITS)
    assert raised.value.field == field
    assert str(raised.value).startswith(message), str(raised.value)
    assert isinstance(raised.value, InvalidArgument)  # INVALID_ARGUMENT / 400 wherever it is raised


def test_the_bounds_themselves_are_accepted() -> None:
    GenerationRequest.build(
        method="glide",
        temperature=100.0,
        top_p=1e-6,
        top_k=2**31 - 1,
        max_new_tokens=31,
        stop=["s" * 256] * MAX_STOP_STRINGS,
        seed=2**63 - 1,
        logprobs=True,
        top_logprobs=20,
        limits=LIMITS,
        prompt_ids=[0, 999] * 5,
    )


def test_logprobs_need_a_deployment_that_supports_them() -> None:
    with pytest.raises(InvalidField, match="logprobs are not supported"):
        limits = replace(LIMITS, supports_logprobs=False)
        GenerationRequest.build(method="target", max_new_tokens=8, logprobs=True, limits=limits)


def test_a_lossy_method_at_t_above_0_needs_the_opt_in() -> None:
    GenerationRequest.build(method="mcsd-target-init", temperature=0.0)  # exact at T = 0
    GenerationRequest.build(method="mcsd-target-init", temperature=0.5, allow_lossy=True)
    with pytest.raises(InvalidField, match="is lossy at temperature > 0"):
        GenerationRequest.build(method="vanilla+mcsd-target-3", temperature=0.5)  # named by its axes


def test_a_method_named_by_its_axes_gets_its_name() -> None:
    def named(method: str, limits: RequestLimits = LIMITS) -> str:
        return GenerationRequest.build(method=method, max_new_tokens=8, limits=limits).method

    assert named("glide+cape+svip") == "glide-cape-svip"
    assert named("eagle+cape+cost+suffix") == "eagle-cape-suffix"
    assert named("glide+chain-4+fixed") == "glide"
    assert named("eagle+top2-3+adaedl+suffix") == "eagle+top2-3+adaedl+suffix"  # no name: its own spelling
    router_without_drafts = replace(LIMITS, methods=MethodSupport(in_process=False, draft_models=False))
    assert named("none+suffix", router_without_drafts) == "suffix"
    with pytest.raises(InvalidField, match="'glide\\+cape' is not served here; available: target, suffix"):
        named("glide+cape", router_without_drafts)


def test_default_limits_know_no_model_and_every_method() -> None:
    """What a remote CLI checks before the router does: intrinsic bounds and the default token cap."""
    GenerationRequest.build(method="hf", prompt_ids=[10**9] * 10**4)
    with pytest.raises(InvalidField, match="max_new_tokens"):
        GenerationRequest.build(max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1)


def test_validate_checks_a_request_built_by_hand() -> None:
    request = GenerationRequest(Method.TARGET, SamplingParams(top_k=-3), StoppingParams())
    with pytest.raises(InvalidField, match="top_k"):
        request.validate(LIMITS)


def test_the_serialised_form_round_trips() -> None:
    request = GenerationRequest.build(
        method="glide",
        temperature=0.7,
        top_k=5,
        max_new_tokens=9,
        stop=["a", "bc"],
        seed=3,
        logprobs=True,
        limits=LIMITS,
    )
    again = GenerationRequest.from_dict(request.to_dict())
    assert again == request and again.stopping.stop == ("a", "bc")


def test_with_seed_fixes_a_seed_once() -> None:
    fixed = GenerationRequest.build(seed=None).with_seed()
    assert fixed.seed is not None and 0 <= fixed.seed < 2**63
    assert fixed.with_seed() is fixed


def test_the_stop_logic_of_a_request() -> None:
    text = {1: "a", 2: "b", 3: "STOP", 4: "c", 9: "<eos>"}

    def decode(ids):
        return "".join(text[i] for i in ids)

    stopping = StoppingParams(max_new_tokens=10, stop=("ST",))
    finish = FinishChecker.for_request(stopping, frozenset({9}), decode)
    assert finish.extend([1, 2]) == [1, 2] and not finish.done
    assert finish.extend([3, 4]) == [3]  # the block is cut after the token that completes the stop
    assert finish.reason is FinishReason.STOP and finish.final_text() == "ab"

    ignoring = FinishChecker.for_request(replace(stopping, ignore_eos=True, stop=()), frozenset({9}), decode)
    assert ignoring.extend([9, 1]) == [9, 1] and not ignoring.done
    eos = FinishChecker.for_request(replace(stopping, stop=()), frozenset({9}), decode)
    assert eos.extend([1, 9, 2]) == [1, 9] and eos.reason is FinishReason.EOS
