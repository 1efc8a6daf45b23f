"""Training the learned stopper (specserve.core.decision's DecisionModel) on logged draft tokens: the
paper's recipe (Lu et al., arXiv 2409.10644, 4.2c), with a held-out AUC."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specserve.core.decision import DecisionModel
from specserve.errors import InvalidArgument


@dataclass(frozen=True)
class DecisionTrainSettings:
    """The paper's recipe: BCE, Adam 1e-3, batch 50, 10 epochs, majority class undersampled."""

    epochs: int = 10
    batch_size: int = 50
    lr: float = 1e-3
    held_out_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise InvalidArgument("epochs and batch_size must be >= 1, lr > 0")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise InvalidArgument(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")


@dataclass(frozen=True)
class DecisionReport:
    held_out_auc: float
    held_out_accuracy: float  # at the policy's default threshold, 0.4
    num_train: int  # after undersampling
    num_held_out: int
    train_positive_rate: float  # before undersampling: how often drafted tokens were accepted
    settings: dict


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """scores, labels: [n] -> area under the ROC curve, i.e. P(score of a positive > score of a negative),
    ties counting one half (the Mann-Whitney U statistic over n_pos * n_neg pairs)."""
    labels = labels.bool()
    num_pos, num_neg = int(labels.sum()), int((~labels).sum())
    if num_pos == 0 or num_neg == 0:
        raise InvalidArgument("AUC needs both positive and negative labels")
    scores = scores.double()
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # tied scores share the mean of their ranks
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # [num unique]
    ranks[order] = mean_rank[inverse]
    u = float(ranks[labels].sum()) - num_pos * (num_pos + 1) / 2
    return u / (num_pos * num_neg)


def split_held_out(num_samples: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded permutation cut into (train indices, held-out indices)."""
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    num_held_out = max(1, round(num_samples * fraction))
    return perm[num_held_out:], perm[:num_held_out]


def undersample_majority(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """labels: [n] 0/1 -> indices keeping every minority sample and as many random majority ones."""
    pos, neg = torch.nonzero(labels > 0.5).flatten(), torch.nonzero(labels <= 0.5).flatten()
    minority, majority = (pos, neg) if len(pos) <= len(neg) else (neg, pos)
    kept = majority[torch.randperm(len(majority), generator=generator)[: len(minority)]]
    return torch.cat([minority, kept])


def train_decision_model(
    features: torch.Tensor,  # [n, 11]
    labels: torch.Tensor,  # [n] 1 = accepted
    settings: DecisionTrainSettings | None = None,
) -> tuple[DecisionModel, DecisionReport]:
    settings = settings or DecisionTrainSettings()
    if features.ndim != 2 or features.shape[0] != labels.shape[0]:
        raise InvalidArgument(f"need features [n, F] and labels [n], got {features.shape}, {labels.shape}")
    features, labels = features.float(), labels.float()
    train_idx, held_idx = split_held_out(len(labels), settings.held_out_fraction, settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)  # the Linear layers' initialisation
    model = DecisionModel(num_features=features.shape[1])
    balanced = train_idx[undersample_majority(labels[train_idx], generator)]
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    for _ in range(settings.epochs):
        order = balanced[torch.randperm(len(balanced), generator=generator)]
        for batch in order.split(settings.batch_size):
            optimizer.zero_grad()
            loss_fn(model(features[batch]), labels[batch]).backward()
            optimizer.step()
    model.eval()
    scores = model.predict(features[held_idx])
    report = DecisionReport(
        held_out_auc=roc_auc(scores, labels[held_idx]),
        held_out_accuracy=float(((scores > 0.4).float() == labels[held_idx]).float().mean()),
        num_train=len(balanced),
        num_held_out=len(held_idx),
        train_positive_rate=float(labels[train_idx].mean()),
        settings=asdict(settings),
    )
    return model, report
