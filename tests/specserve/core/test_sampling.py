import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specserve.core.sampling import logits_to_probs
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
