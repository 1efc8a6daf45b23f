"""Sessions run concurrently (their forwards batched) produce exactly what each produces alone: greedy
output token for token, seeded sampling the same tokens, and sampling the target's distribution. Greedy
and seeded sampling on each architecture's tiny target (Llama, Qwen2)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from tiny_llama import EACH_ARCHITECTURE, exact_joint_of_tokens_2_and_3, noisy_copy, tiny_llama

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind
from specserve.core.sampling_params import SamplingParams
from specserve.runtime.batching import Scheduler
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

CAPACITY = 256
PROMPTS = [[3, 17, 5, 9, 41, 2, 33, 8], [1, 2], [60, 61, 5, 5, 5, 7, 9, 11, 13, 15, 17, 19, 21], [4]]
SHAPES = [None, DraftShape(depth=4), DraftShape(depth=3, widths=(3, 2))]


def session(target, draft, shape, prompt, params, seed, prefill_chunk=256, max_new_tokens=30):
    def run() -> list[int]:
        finish = FinishChecker(max_new_tokens, frozenset())
        drafter = None if shape is None else ModelDrafter(draft, CAPACITY, shape, params)
        verifier = LocalVerifier(target, CAPACITY, prefill_chunk=prefill_chunk, sampling=params)
        speculative_generate(prompt, verifier, drafter, seed, finish)
        return list(finish.generated)

    return run


@EACH_ARCHITECTURE
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_batched_equals_each_session_alone(target, draft, shape):
    params = SamplingParams()
    alone = [session(target, None, None, p, params, 0)() for p in PROMPTS]
    scheduler = Scheduler(max_tokens_per_forward=16)
    # mixed methods and prefill chunk sizes in one batch: sessions join and leave between forwards
    jobs = [session(target, draft, shape, p, params, 0, prefill_chunk=3) for p in PROMPTS]
    jobs.append(session(target, None, None, PROMPTS[0], params, 0, max_new_tokens=5))
    batched = scheduler.run_all(jobs)
    assert batched[: len(PROMPTS)] == alone
    assert batched[-1] == alone[0][:5]
    assert scheduler.stats.segments > 1.5 * scheduler.stats.forwards  # forwards were shared


@EACH_ARCHITECTURE
def test_seeded_sampling_batched_equals_alone(target, draft):
    params = SamplingParams(temperature=0.9)
    shape = DraftShape(depth=3, widths=(2, 2))
    alone = [
        session(target, draft, shape, p, params, 7 + i, max_new_tokens=20)() for i, p in enumerate(PROMPTS)
    ]
    batched = Scheduler().run_all(
        [session(target, draft, shape, p, params, 7 + i, max_new_tokens=20) for i, p in enumerate(PROMPTS)]
    )
    assert batched == alone


@pytest.mark.compute_only
def test_batched_sampling_preserves_target_distribution():
    """Tokens 2 and 3 come from the first speculative round; 2000 sessions run 500 at a time."""
    vocab = 4
    target = ModelRunner(tiny_llama(vocab_size=vocab, hidden=16, layers=1, seed=3))
    draft = ModelRunner(noisy_copy(target.model, scale=1.0, seed=4))
    shape = DraftShape(depth=2, widths=(2, 2), sampled_kind=CandidateKind.SAMPLED_WITHOUT_REPLACEMENT)
    prompt = [1, 2, 3, 0, 1]
    params = SamplingParams(temperature=1.0)
    trials, wave = 2000, 500
    counts = torch.zeros(vocab, vocab)
    for first in range(0, trials, wave):
        outputs = Scheduler(max_tokens_per_forward=4096).run_all(
            [
                session(target, draft, shape, prompt, params, seed, max_new_tokens=3)
                for seed in range(first, first + wave)
            ]
        )
        for generated in outputs:
            counts[generated[1], generated[2]] += 1
    expected = exact_joint_of_tokens_2_and_3(target.model, prompt, params, vocab) * trials
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"
