"""The engine on the real default model (SmolLM2-135M-Instruct): lossless against transformers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from shipped_methods import SHIPPED_DRAFT_METHODS

from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.methods import METHODS, Method
from specserve.settings import EngineSettings

pytestmark = pytest.mark.compute_only  # the real model's outputs in process

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying focused while studying.",
]
# The shipped-draft methods have their own real-model equality test (tests/shipped_methods.py).
LOSSLESS = [
    m
    for m, spec in METHODS.items()
    if spec.lossless
    and m is not Method.HF
    and m.value not in SHIPPED_DRAFT_METHODS
    # A separate draft model's methods: the tiny models' test and the real Qwen profile's prove them.
    and m
    not in (Method.HF_ASSISTED, Method.VANILLA_CAPE_COST, Method.VANILLA_CAPE_SUFFIX, Method.VANILLA_GATED)
]


@pytest.fixture(scope="module")
def engine(pinned_costs) -> Engine:
    """The engine on the dense float32 checkpoint: what transformers' `generate` runs, token for token
    (on the file's own weights, the default on a CPU, the target is the quantized model, whose output
    the other model tests compare every method with). Trees sized from the suite's cost record
    (tests/pinned_costs.py): measuring this model's costs took half a minute of the suite."""
    return Engine(EngineSettings.from_env(weights="dense", calibration_path=pinned_costs))


@pytest.mark.model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(engine, prompt):
    # 32 tokens: several rounds of every method; longer answers are the shipped-draft and stack tests' job
    # (this test alone took 3 of CI's 16 minutes at 48). Each method runs on one of the prompts, in turn:
    # every method against transformers on a real prompt, every prompt against several methods, a third
    # of the dense forwards (the three prompts with every method took 72 of CI's seconds).
    reference = engine.generate(prompt, GenerationRequest.build(method=Method.HF, max_new_tokens=32))
    assert len(reference.token_ids) > 5
    for method in LOSSLESS[PROMPTS.index(prompt) :: len(PROMPTS)]:
        result = engine.generate(prompt, GenerationRequest.build(method=method, max_new_tokens=32))
        assert result.token_ids == reference.token_ids, method
        assert result.text == reference.text


@pytest.mark.model
def test_sampling_is_seeded_on_the_real_model(engine):
    request = GenerationRequest.build(
        method=Method.VANILLA_TREE, temperature=0.8, top_p=0.95, seed=42, max_new_tokens=24
    )
    a = engine.generate(PROMPTS[2], request)
    b = engine.generate(PROMPTS[2], request)
    assert a.token_ids == b.token_ids


@pytest.mark.model
def test_stop_string_cuts_text_and_tokens(engine):
    full = engine.generate(PROMPTS[1], GenerationRequest.build(method=Method.TARGET, max_new_tokens=48))
    stop = full.text.split()[3]  # a word that certainly appears
    request = GenerationRequest.build(method=Method.VANILLA, max_new_tokens=48, stop=(stop,))
    cut = engine.generate(PROMPTS[1], request)
    assert cut.finish_reason.value == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


TARGET = GenerationRequest(method=Method.TARGET)


@pytest.mark.model
@pytest.mark.parametrize(
    "prompt,request_",
    [
        ("", TARGET),
        ("   ", TARGET),
        ("hello " * 9000, TARGET),  # longer than the model's 8,192-token context
        ("hello", replace(TARGET, method="nonsense")),
        ("hello", replace(TARGET, stopping=replace(TARGET.stopping, max_new_tokens=0))),
        ("hello", replace(TARGET, sampling=replace(TARGET.sampling, temperature=-1))),
    ],
)
def test_bad_requests_are_invalid_arguments(engine, prompt, request_):
    """Requests built without `GenerationRequest.build`: the engine validates what it is given."""
    with pytest.raises(InvalidArgument):
        engine.generate(prompt, request_)


@pytest.mark.model
def test_transformers_with_ignore_eos_runs_past_eos_as_the_target_does(engine: Engine) -> None:
    """transformers fills an unset eos from the model's config; with ignore_eos it must not stop there."""
    ids = engine.encode_prompt("Say only: yes.")
    request = GenerationRequest.build(method="target", max_new_tokens=40, ignore_eos=True)
    target = engine.generate_ids(ids, request)
    assert any(t in engine.eos_token_ids for t in target.token_ids)  # the answer ends early: eos inside
    hf = engine.generate_ids(ids, replace(request, method="hf"))
    assert hf.token_ids == target.token_ids and hf.finish_reason == "length"
    stopped = engine.generate_ids(ids, GenerationRequest.build(method="hf", max_new_tokens=40))
    assert stopped.finish_reason == "eos" and len(stopped.token_ids) < 40
