"""Shared, session-scoped model fixtures.

- default_model_dir: the real SmolLM2-135M-Instruct checkpoint, converted once per machine into
  $SPECSERVE_CACHE_DIR (or the user cache, ~/.cache/specserve), the same place the engine uses.
- tiny_target_dir / tiny_draft_dir: random-init Llamas with SmolLM2's real tokenizer (vocab 49,152),
  target 2 layers x 64 wide, draft 1 layer x 32 wide, different seeds.
- tiny_vocab_target_dir: a random-init Llama with vocab 16 and no tokenizer, for statistical tests
  (the whole next-token distribution is small enough to check exactly).
- tiny_qwen2_target_dir: tiny_target_dir's Qwen2 counterpart (q/k/v biases, head_dim 32 with hidden 64
  and 4 heads, RoPE theta 1e6, tied head; specserve/models/tiny.py), same tokenizer.
- default_engine: the in-process engine on the default model's settings from the environment (the
  shipped model and drafts unless the environment names others), one per session: each load of the real
  model and its drafts takes seconds. It prices trees from `pinned_costs` (tests/pinned_costs.py), as
  the suite's stacks on the default model do.
- architecture: Llama, unless a test runs on each architecture (tiny_llama.EACH_ARCHITECTURE);
  architecture_target_dir: the tiny target of that architecture.

And the suite's tiers (`bash scripts/test.sh unit` / `compute` / `integration`; no test is in two): a test
is an integration test, marked `integration` here at collection, when it needs more than this process and
the tiny models: it carries a marker that says so (`INTEGRATION_MARKERS`), or uses a fixture that starts or
loads something real (`INTEGRATION_FIXTURES`, whichever test module asks for it). A test module that starts
processes itself says so with `pytestmark = pytest.mark.integration`. A test marked `compute_only` (long
computation with no clock, port or service in it: the sampling statistics, the real model's outputs in
process) is in the compute tier, whichever of the other two it would be in; the whole suite runs that
tier beside the integration tier, at idle CPU priority.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pinned_costs import write_pinned_costs
from tier_order import compute_tier_rank

from specserve.models import default_model_dir as _default_model_dir
from specserve.models import make_tiny_llama
from specserve.models.tiny import Architecture, make_tiny_model
from specserve.settings import EngineSettings

# Markers that already mean more than this process and the tiny models (pyproject.toml describes each).
INTEGRATION_MARKERS = frozenset({"model", "distributed", "ray", "large_model"})
INTEGRATION_FIXTURES = frozenset(
    {
        "default_engine",  # the real model and the shipped drafts, in process
        "held_out",  # the real model's answers to held-out prompts (tests/specserve/drafts)
        "shared_stack",  # Redis, target, draft and router processes (tests/services), and what builds on it
        "browser",  # headless Chromium (the playground page)
        "ray_local",  # a local Ray instance (the training pipeline)
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        markers = {marker.name for marker in item.iter_markers()}
        fixtures = set(getattr(item, "fixturenames", ()))
        if markers & INTEGRATION_MARKERS or fixtures & INTEGRATION_FIXTURES:
            item.add_marker(pytest.mark.integration)
    items.sort(key=compute_tier_rank)  # stable: every other test keeps its place among the others


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return _default_model_dir(EngineSettings.from_env().cache_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny_target")
    return make_tiny_llama(out, tokenizer_dir=default_model_dir, hidden_size=64, num_layers=2, seed=1)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny_draft")
    return make_tiny_llama(
        out,
        tokenizer_dir=default_model_dir,
        hidden_size=32,
        num_layers=1,
        intermediate_size=64,
        seed=2,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_target_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny_qwen2_target")
    return make_tiny_model(
        out,
        architecture=Architecture.QWEN2,
        tokenizer_dir=default_model_dir,
        hidden_size=64,
        num_layers=2,
        seed=1,
    )


@pytest.fixture(scope="session")
def architecture() -> Architecture:
    """The tiny models' architecture; tests marked tiny_llama.EACH_ARCHITECTURE get each in turn."""
    return Architecture.LLAMA


@pytest.fixture(scope="module")
def architecture_target_dir(architecture: Architecture, request: pytest.FixtureRequest) -> Path:
    """tiny_target_dir or tiny_qwen2_target_dir, by `architecture`."""
    name = {Architecture.LLAMA: "tiny_target_dir", Architecture.QWEN2: "tiny_qwen2_target_dir"}[architecture]
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def tiny_vocab_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_vocab_target"), vocab_size=16, seed=3)


@pytest.fixture(scope="session")
def pinned_costs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cost record the default model's engines and stacks read in the suite (tests/pinned_costs.py)."""
    return write_pinned_costs(tmp_path_factory.mktemp("pinned_costs") / "calibration.json")


@pytest.fixture(scope="session")
def default_engine(pinned_costs: Path):
    """The in-process engine on the default model and shipped drafts: the reference output."""
    from specserve.engine import Engine

    return Engine(EngineSettings.from_env(calibration_path=pinned_costs))
