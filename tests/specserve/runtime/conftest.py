"""The runtime tests' tiny models: a random target and a noisy copy of it as the draft (it accepts some
tokens and rejects others). One of each per test module and architecture (Llama unless a test runs on
each, tiny_llama.EACH_ARCHITECTURE)."""

from __future__ import annotations

import pytest
from tiny_llama import noisy_copy, tiny_model

from specserve.models.tiny import Architecture
from specserve.runtime.runner import ModelRunner


@pytest.fixture(scope="module")
def target(architecture: Architecture) -> ModelRunner:
    return ModelRunner(tiny_model(architecture))


@pytest.fixture(scope="module")
def draft(target: ModelRunner) -> ModelRunner:
    return ModelRunner(noisy_copy(target.model, scale=0.6))
