"""The shipped GliDe draft's held-out agreement with the target has a floor (`eval-draft`'s metric).

A smaller `eval-draft` (conftest.py), the shipped draft teacher-forced under the training block mask.
Measured here (2 CPU cores, 2026-11-22): the shipped draft 0.268 overall and 0.291 at the first draft
token; the draft shipped before it 0.214 and 0.251. Both floors sit between the two, so a regression to
that draft (or anything worse) fails.
"""

from __future__ import annotations

import pytest

from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.glide.model import load_glide
from specserve.training.evaluate import evaluate_draft

pytestmark = [pytest.mark.model, pytest.mark.compute_only]

FIRST_TOKEN_FLOOR = 0.27
OVERALL_FLOOR = 0.24


def test_the_shipped_glide_draft_agrees_with_the_target_on_held_out_answers(held_out) -> None:
    draft = load_glide(shipped_draft_dir(DraftKind.GLIDE), held_out.target)
    result = evaluate_draft(
        held_out.target,
        draft,
        held_out.sequences,
        held_out.answer_starts,
        held_out.pad_id,
        batch_size=16,
        progress=False,
    )
    assert sum(result.scored) > 800
    assert result.by_lag[0] >= FIRST_TOKEN_FLOOR, result.to_json()
    assert result.overall >= OVERALL_FLOOR, result.to_json()
