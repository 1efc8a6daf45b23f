"""`train-stopper`'s logging on the real default model, for each draft a stopper is trained on: what it
logs are that draft's own chains, labelled by the target's greedy choice."""

from __future__ import annotations

import pytest
import torch

from specserve.core.decision import NUM_FEATURES
from specserve.drafts import DraftKind
from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.training.stopper import StopperLogSettings, log_stopper_data

pytestmark = pytest.mark.model

DEPTH = 3


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


@pytest.fixture(scope="module")
def logs(engine: Engine) -> dict[DraftKind, tuple[torch.Tensor, torch.Tensor]]:
    return {
        kind: log_stopper_data(engine, StopperLogSettings(2, 16, DEPTH, draft=kind))
        for kind in (DraftKind.GLIDE, DraftKind.EAGLE)
    }


@pytest.mark.parametrize("kind", [DraftKind.GLIDE, DraftKind.EAGLE])
def test_every_drafted_token_is_logged_with_a_label(logs, kind: DraftKind) -> None:
    features, labels = logs[kind]
    assert features.shape == (len(labels), NUM_FEATURES) and len(labels) >= DEPTH * 4
    assert len(labels) % DEPTH == 0  # whole chains: every token of a round is judged, rejected or not
    assert set(labels.tolist()) == {0.0, 1.0}  # trained drafts: some tokens accepted, some not


def test_each_draft_logs_its_own_tokens(logs) -> None:
    """The same prompts and target: the two drafts' distributions differ, so their features do."""
    glide, eagle = logs[DraftKind.GLIDE][0], logs[DraftKind.EAGLE][0]
    rows = min(len(glide), len(eagle))
    assert not torch.allclose(glide[:rows], eagle[:rows])


def test_a_draft_without_a_stopper_path_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="stopper"):
        StopperLogSettings(draft=DraftKind.VANILLA)
