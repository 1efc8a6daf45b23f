import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specserve.core.sampling import logits_to_probs, sample_token, sample_without_replacement
from specserve.core.sampling_params import SamplingParams


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert torch.equal(logits_to_probs(logits, SamplingParams()), torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 7, 0.5)]
)
def test_matches_hugging_face_warpers(temperature, top_k, top_p):
    """The hf baseline must sample from the very distribution our verifier targets."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    ours = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(ours, torch.softmax(scores, -1))


def test_top_k_keeps_k_tokens():
    probs = logits_to_probs(torch.arange(10.0), SamplingParams(temperature=1.0, top_k=3))
    assert (probs > 0).sum() == 3 and probs[-3:].sum() == pytest.approx(1.0)


def test_a_drawn_token_follows_its_probability_and_a_seed_repeats_it():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3e-3, 0.0, 0.2997])
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.bincount(torch.tensor([sample_token(probs, generator) for _ in range(draws)]), minlength=6)
    assert counts[1] == 0 and counts[4] == 0  # a token of probability 0 is never drawn
    kept = probs > 0
    assert chisquare(counts[kept].numpy(), (probs[kept] / probs.sum() * draws).numpy()).pvalue > 1e-3
    first = [sample_token(probs, torch.Generator().manual_seed(seed)) for seed in range(50)]
    assert first == [sample_token(probs, torch.Generator().manual_seed(seed)) for seed in range(50)]


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_a_large_vocabulary_keeps_its_rare_tokens_and_its_last_one(vocab):
    """float64 sums: a token of one part in 10^7 at the end of 151,936 float32 terms keeps its interval."""
    probs = torch.zeros(vocab)
    probs[-1], probs[0] = 1.0, 0.0
    assert sample_token(probs, torch.Generator().manual_seed(1)) == vocab - 1
    probs = torch.full((vocab,), 1e-7)
    probs[vocab // 2] = 1.0 - 1e-7 * (vocab - 1)
    probs[-1] = 0.0  # never drawn, though it is last
    tokens = {sample_token(probs, torch.Generator().manual_seed(seed)) for seed in range(300)}
    assert vocab // 2 in tokens and vocab - 1 not in tokens


def test_a_draw_at_the_very_top_of_the_sum_takes_the_last_possible_token(monkeypatch):
    probs = torch.tensor([0.25, 0.75, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sample_token(probs, torch.Generator()) == 1


def test_without_replacement_goes_uniform_once_q_is_used_up():
    q = torch.tensor([0.0, 1.0, 0.0, 0.0])
    drawn = sample_without_replacement(q, 4, torch.Generator().manual_seed(0))
    assert drawn[0] == 1 and sorted(drawn) == [0, 1, 2, 3]


def test_distinct_draws_follow_q_renormalised_over_the_untried_tokens():
    """The pair (first, second) drawn from q = [0.5, 0.3, 0.2]: P(a, b) = q_a * q_b / (1 - q_a)."""
    q = torch.tensor([0.5, 0.3, 0.2])
    generator = torch.Generator().manual_seed(3)
    draws = 12000
    pairs = [tuple(sample_without_replacement(q, 2, generator)) for _ in range(draws)]
    order = [(a, b) for a in range(3) for b in range(3) if a != b]
    observed = [pairs.count(pair) for pair in order]
    expected = [float(q[a]) * float(q[b]) / (1 - float(q[a])) * draws for a, b in order]
    expected[-1] += draws - sum(expected)  # float rounding: chi-square wants equal totals
    assert all(a != b for a, b in pairs)
    assert chisquare(observed, expected).pvalue > 1e-3
