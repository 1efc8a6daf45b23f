"""What the shipped drafts' agreement floors share: the real target and its held-out answers, made once.

A smaller `eval-draft`: the first 2 MT-Bench first turns of each category, 64-token greedy answers of the
real target (~990 answer positions)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from specserve.bench.prompts import load_prompts, per_category
from specserve.models import load_causal_lm, load_tokenizer
from specserve.training.evaluate import held_out_answers


@dataclass(frozen=True)
class HeldOut:
    target: object  # the float32 target (a transformers causal LM)
    sequences: list[list[int]]  # prompt + greedy answer ids
    answer_starts: list[int]
    pad_id: int


@pytest.fixture(scope="session")
def held_out(default_model_dir, tmp_path_factory) -> HeldOut:
    target = load_causal_lm(default_model_dir)
    tokenizer = load_tokenizer(default_model_dir)
    prompts = [p.text for p in per_category(load_prompts(), 2)]
    # A run's pytest-xdist workers (the compute tier) share one set of answers: the first worker to
    # get here generates them, another waits for it and reads them.
    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    where = tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.mktemp("held-out")
    with _exclusive(where / "held-out.lock"):
        cache = where / "held-out-answers.json"
        sequences, starts = held_out_answers(target, tokenizer, prompts, 64, cache, batch_size=16)
    return HeldOut(target, sequences, starts, tokenizer.eos_token_id)


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Holds an exclusive lock on the file `lock` (made if missing) for the block."""
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
