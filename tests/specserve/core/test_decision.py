"""The learned stopper: its features, AUC, training on a hand-made logged set, safetensors round trip."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.decision import NUM_FEATURES, DecisionModel, decision_features
from specserve.errors import InvalidArgument, NotFound
from specserve.runtime.stopper import load_decision_model, save_decision_model
from specserve.training.decision import (
    DecisionTrainSettings,
    roc_auc,
    train_decision_model,
    undersample_majority,
)


def test_features_are_entropy_then_zero_padded_top_probabilities():
    probs = torch.tensor([0.2, 0.5, 0.3])
    features = decision_features(probs.log())
    entropy = -sum(p * math.log(p) for p in (0.2, 0.5, 0.3))
    expected = torch.tensor([entropy, 0.5, 0.3, 0.2] + [0.0] * 7)
    assert features.shape == (NUM_FEATURES,)
    assert torch.allclose(features, expected, atol=1e-6)


def test_features_of_a_reduced_head_ignore_minus_infinity_and_batch():
    logits = torch.full((2, 20), float("-inf"))
    logits[:, :2] = 0.0  # two equally likely tokens
    features = decision_features(logits)  # [2, 11]
    assert features.shape == (2, NUM_FEATURES)
    assert torch.allclose(features[:, 0], torch.tensor(math.log(2)))
    assert torch.allclose(features[:, 1:3], torch.tensor(0.5)) and features[:, 3:].abs().sum() == 0


@pytest.mark.parametrize(
    "scores,labels,expected",
    [
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),  # sklearn's documented example
        ([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], 1.0),
        ([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1], 0.0),
        ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),  # ties count one half
        ([0.2, 0.5, 0.5, 0.9], [0, 0, 1, 1], 0.875),  # one tied pair of 4
    ],
)
def test_auc_by_hand(scores, labels, expected):
    assert roc_auc(torch.tensor(scores), torch.tensor(labels)) == pytest.approx(expected)


def test_auc_needs_both_labels():
    with pytest.raises(InvalidArgument):
        roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1]))


def test_undersampling_keeps_every_minority_sample():
    labels = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0])
    kept = undersample_majority(labels, torch.Generator().manual_seed(0))
    assert sorted(labels[kept].tolist()) == [0, 0, 1, 1]
    assert {6, 7} <= set(kept.tolist())


def hand_logged_set(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of random draft distributions; 'accepted' iff the draft was sure (top prob > 0.6), the
    rule a real log roughly follows. About 2 in 5 accepted, so undersampling has work to do."""
    g = torch.Generator().manual_seed(seed)
    sharpness = torch.rand(num, 1, generator=g) * 8  # flat .. peaked
    logits = torch.randn(num, 50, generator=g) * sharpness
    features = decision_features(logits)  # [num, 11]
    labels = (features[:, 1] > 0.6).float()
    return features, labels


def test_training_learns_a_separable_rule_and_round_trips(tmp_path):
    features, labels = hand_logged_set(2000, seed=0)
    assert 0.2 < float(labels.mean()) < 0.45
    model, report = train_decision_model(features, labels, DecisionTrainSettings(epochs=10, seed=0))
    assert report.held_out_auc > 0.95
    assert report.num_held_out == 400 and report.num_train < 1400  # undersampled
    # an unseen set, scored by the reloaded model: same predictions, still separable
    test_features, test_labels = hand_logged_set(500, seed=1)
    save_decision_model(model, tmp_path, {"held_out_auc": report.held_out_auc, "train_positive_rate": 0.75})
    loaded = load_decision_model(tmp_path)
    assert torch.equal(loaded.predict(test_features), model.predict(test_features))
    assert loaded.positive_rate == 0.75
    assert roc_auc(loaded.predict(test_features), test_labels) > 0.95
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.pt"))


def test_training_on_noise_stays_near_chance():
    """The same training cannot invent a rule that is not there: the test above can fail."""
    features, _ = hand_logged_set(2000, seed=0)
    labels = (torch.rand(2000, generator=torch.Generator().manual_seed(5)) < 0.5).float()
    _, report = train_decision_model(features, labels)
    assert abs(report.held_out_auc - 0.5) < 0.1


def test_loading_a_missing_stopper_is_not_found(tmp_path):
    with pytest.raises(NotFound):
        load_decision_model(tmp_path / "nothing")


def test_model_shape_is_the_papers():
    model = DecisionModel()
    assert [tuple(p.shape) for p in model.parameters()] == [(44, 11), (44,), (1, 44), (1,)]
