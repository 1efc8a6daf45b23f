"""The shipped GliDe draft's held-out agreement with the target has a floor (`eval-draft`'s metric).

A smaller `eval-draft`: the first 2 MT-Bench first turns of each category, 64-token greedy answers of the
real target (990 answer positions), the shipped draft teacher-forced under the training block mask.
Measured here (2 CPU cores, 2026-11-22): the shipped draft 0.268 overall and 0.291 at the first draft
token; the draft shipped before it 0.214 and 0.251. Both floors sit between the two, so a regression to
that draft (or anything worse) fails.
"""

from __future__ import annotations

import pytest

from specserve.bench.prompts import load_prompts, per_category
from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.glide.model import load_glide
from specserve.models import load_causal_lm, load_tokenizer
from specserve.training.evaluate import evaluate_draft, held_out_answers

pytestmark = pytest.mark.model

FIRST_TOKEN_FLOOR = 0.27
OVERALL_FLOOR = 0.24


def test_the_shipped_glide_draft_agrees_with_the_target_on_held_out_answers(
    default_model_dir, tmp_path
) -> None:
    target = load_causal_lm(default_model_dir)
    tokenizer = load_tokenizer(default_model_dir)
    draft = load_glide(shipped_draft_dir(DraftKind.GLIDE), target)
    prompts = [p.text for p in per_category(load_prompts(), 2)]
    sequences, starts = held_out_answers(
        target, tokenizer, prompts, 64, tmp_path / "answers.json", batch_size=16
    )
    result = evaluate_draft(
        target, draft, sequences, starts, tokenizer.eos_token_id, batch_size=16, progress=False
    )
    assert sum(result.scored) > 800
    assert result.by_lag[0] >= FIRST_TOKEN_FLOOR, result.to_json()
    assert result.overall >= OVERALL_FLOOR, result.to_json()
