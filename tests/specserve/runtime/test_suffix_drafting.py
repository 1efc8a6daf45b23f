"""Suffix candidates, alone and merged with a model draft, on a real (tiny) model: greedy output equals
the target alone's, also batched; sampling keeps the target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from tiny_llama import exact_joint_of_tokens_2_and_3, noisy_copy, tiny_llama

from specserve.core.cost import CostModel
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind
from specserve.core.sampling_params import SamplingParams
from specserve.core.suffix_drafter import SuffixDrafter, SuffixSettings
from specserve.runtime.batching import Scheduler
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

CAPACITY = 512
# Repetitive prompts: a small random model continues them with text the index has seen.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43]]
FLAT_COST = CostModel(((1, 1.0), (8, 1.1), (16, 1.3), (64, 3.0)), draft_step_s=0.05)


def run(target, drafter_factory, prompt, params, seed=0, max_new_tokens=40):
    finish = FinishChecker(max_new_tokens, frozenset())
    verifier = LocalVerifier(target, CAPACITY, sampling=params)
    stats = speculative_generate(prompt, verifier, drafter_factory(), seed, finish)
    return list(finish.generated), stats


def test_greedy_output_equals_the_target_alone_with_suffix_candidates(target, draft):
    greedy = SamplingParams()
    shape = DraftShape(depth=3, widths=(2, 1))
    accepted_from_suffix = 0
    for prompt in PROMPTS:
        expected, _ = run(target, lambda: None, prompt, greedy)
        alone, stats = run(target, lambda: SuffixDrafter(None, 32, FLAT_COST), prompt, greedy)
        merged, merged_stats = run(
            target,
            lambda: SuffixDrafter(ModelDrafter(draft, CAPACITY, shape, greedy), 32, FLAT_COST),
            prompt,
            greedy,
        )
        assert alone == expected and merged == expected
        assert stats.num_suffix_draft_tokens == stats.num_draft_tokens  # no model: every draft is suffix
        accepted_from_suffix += stats.num_suffix_accepted_tokens
        assert merged_stats.num_suffix_accepted_tokens <= merged_stats.num_accepted_tokens
    assert accepted_from_suffix > 0  # the repetitive prompts did draft


def test_greedy_batched_sessions_with_suffix_candidates_equal_each_alone(target):
    greedy = SamplingParams()
    alone = [run(target, lambda: None, p, greedy)[0] for p in PROMPTS]

    def job(prompt):
        return lambda: run(target, lambda: SuffixDrafter(None, 32, FLAT_COST), prompt, greedy)[0]

    assert Scheduler(max_tokens_per_forward=64).run_all([job(p) for p in PROMPTS]) == alone


@pytest.mark.compute_only
def test_sampling_with_mixed_suffix_and_model_candidates_keeps_the_target_distribution():
    """Tokens 2 and 3 come from the first speculative round, whose tree mixes suffix candidates (the
    prompt repeats, so the index proposes) and a model draft's fixed candidates."""
    vocab = 4
    target = ModelRunner(tiny_llama(vocab_size=vocab, hidden=16, layers=1, seed=3))
    draft = ModelRunner(noisy_copy(target.model, scale=1.0, seed=4))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    shape = DraftShape(depth=2, widths=(2, 2))  # fixed (top-k) candidates under CaPE-like widths
    settings = SuffixSettings(min_score=0.0, model_skip_tokens=100.0)  # always merge both

    def make():
        model = ModelDrafter(draft, CAPACITY, shape, params)
        model.kind = CandidateKind.FIXED  # deterministic top-k, as CaPE's trees are
        return SuffixDrafter(model, 16, None, settings)

    trials, wave = 2000, 500
    counts = torch.zeros(vocab, vocab)
    mixed_rounds = 0
    for first in range(0, trials, wave):
        jobs = [
            (lambda seed=seed: run(target, make, prompt, params, seed=seed, max_new_tokens=3))
            for seed in range(first, first + wave)
        ]
        for generated, stats in Scheduler(max_tokens_per_forward=4096).run_all(jobs):
            counts[generated[1], generated[2]] += 1
            mixed_rounds += 0 < stats.num_suffix_draft_tokens < stats.num_draft_tokens
    assert mixed_rounds > trials // 2
    expected = exact_joint_of_tokens_2_and_3(target.model, prompt, params, vocab) * trials
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"
