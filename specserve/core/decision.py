"""The learned stopper of improved MCSD (Lu et al., arXiv 2409.10644, 4.2c, the "hard" model).

A small MLP reads one drafted token's features, [entropy, top-10 probabilities] of the draft distribution
it was drawn from (T = 1), and predicts the probability that the target accepts it. The `decision` stop
policy (core/stopping.py) ends a round once that prediction is <= 0.4; the `cost` policy uses it as the
per-token acceptance a_i of its expected-tokens model (core/cost.py).

Labels are logged from our own runs (`specserve train-stopper`): 1 when the drafted token equals the
target's greedy choice after the same prefix, else 0. Every drafted token gets a label, including those
after a rejection: the policy is asked about every token too, before anything is verified.

Worked example of the features: draft probabilities (0.5, 0.3, 0.2) over a 3-token vocabulary give
[1.0297, 0.5, 0.3, 0.2, 0, 0, 0, 0, 0, 0, 0] (entropy in nats, then the top 10, zero-padded).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.errors import InvalidArgument, NotFound

NUM_TOP_PROBS = 10
NUM_FEATURES = 1 + NUM_TOP_PROBS  # entropy, then the top-10 probabilities
HIDDEN_SIZE = 44  # the paper's 11 -> 44 -> 1
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "stopper.json"


def decision_features(logits: torch.Tensor) -> torch.Tensor:
    """logits: [..., V] raw draft logits -> [..., 11] float32: entropy (nats, T = 1), top-10 probs.

    -inf logits (a reduced draft head) are tokens of probability 0; fewer than 10 tokens pad with 0.
    """
    log_probs = torch.log_softmax(logits.double(), dim=-1)  # [..., V]
    probs = log_probs.exp()
    # p log p -> 0 as p -> 0; written out because 0 * -inf is nan
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1, keepdim=True)
    k = min(NUM_TOP_PROBS, probs.shape[-1])
    top = torch.topk(probs, k, dim=-1).values  # [..., k]
    pad = torch.zeros(*top.shape[:-1], NUM_TOP_PROBS - k, dtype=top.dtype, device=top.device)
    return torch.cat([entropy, top, pad], dim=-1).float()  # [..., 11]


class DecisionModel(nn.Module):
    """[..., 11] features -> [...] logit of P(accepted); `predict` applies the sigmoid."""

    def __init__(self, num_features: int = NUM_FEATURES, hidden_size: int = HIDDEN_SIZE) -> None:
        super().__init__()
        self.num_features, self.hidden_size = num_features, hidden_size
        # Share of accepted tokens in the logged data before undersampling; trained on balanced classes,
        # predictions are corrected back to it where a calibrated probability is needed (the cost policy).
        self.positive_rate = 0.5
        self.net = nn.Sequential(nn.Linear(num_features, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)

    @torch.inference_mode()
    def predict(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(features.float()))

    def acceptance(self, logits: torch.Tensor) -> float:
        """logits: [V] of one drafted token -> its predicted acceptance probability."""
        return float(self.predict(decision_features(logits)))


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


def save_decision_model(model: DecisionModel, directory: Path, record: dict) -> Path:
    """Writes model.safetensors and stopper.json (sizes plus `record`: AUC, data, settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE))
    sizes = {"num_features": model.num_features, "hidden_size": model.hidden_size}
    (directory / RECORD_FILE).write_text(json.dumps({**sizes, **record}, indent=2) + "\n")
    return directory


@functools.lru_cache(maxsize=8)
def load_decision_model(directory: Path) -> DecisionModel:
    """Cached: every request's policy shares one read-only model."""
    weights, record_path = directory / WEIGHTS_FILE, directory / RECORD_FILE
    if not weights.is_file() or not record_path.is_file():
        raise NotFound(f"no stopper in {directory} (need {WEIGHTS_FILE} and {RECORD_FILE})")
    record = json.loads(record_path.read_text())
    model = DecisionModel(record["num_features"], record["hidden_size"])
    model.load_state_dict(load_file(str(weights)))
    model.positive_rate = float(record.get("train_positive_rate", 0.5))
    return model.eval().requires_grad_(False)
