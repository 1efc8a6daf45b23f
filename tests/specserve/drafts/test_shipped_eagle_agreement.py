"""The shipped hidden-state draft's held-out agreement with the target has a floor (`eval-draft`'s metric).

The same held-out answers as the GliDe floor (conftest.py), the draft reading the target's final hidden
states and, for lags past the first, its own outputs, as when it drafts. Measured here (2 CPU cores,
2026-11-25): the shipped draft 0.361 at the first draft token and 0.288 overall (990 positions a lag);
the draft it replaced (the same draft before 900 more steps over twice the data) scored 0.317 and 0.266,
the one before that 0.254 and 0.214. The floors sit about two standard errors below the shipped draft,
so the drafts it replaced, or an undertrained one, fail.
"""

from __future__ import annotations

import pytest

from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.eagle.model import load_eagle
from specserve.training.eagle import held_out_hidden, score_eagle

pytestmark = [pytest.mark.model, pytest.mark.compute_only]

FIRST_TOKEN_FLOOR = 0.33
OVERALL_FLOOR = 0.27


def test_the_shipped_hidden_state_draft_agrees_with_the_target_on_held_out_answers(held_out) -> None:
    draft = load_eagle(shipped_draft_dir(DraftKind.EAGLE), held_out.target)
    batches = held_out_hidden(
        held_out.target, held_out.sequences, held_out.answer_starts, held_out.pad_id, batch_size=16
    )
    result = score_eagle(draft, batches)
    assert sum(result.scored) > 800
    assert result.by_lag[0] >= FIRST_TOKEN_FLOOR, result.to_json()
    assert result.overall >= OVERALL_FLOOR, result.to_json()
