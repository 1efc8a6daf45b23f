"""The learned stopper of improved MCSD (Lu et al., arXiv 2409.10644, 4.2c, the "hard" model).

A small MLP reads one drafted token's features, [entropy, top-10 probabilities] of the draft distribution
it was drawn from (T = 1), and predicts the probability that the target accepts it. The `decision` stop
policy (core/stopping.py) ends a round once that prediction is <= 0.4; the `cost` policy uses it as the
per-token acceptance a_i of its expected-tokens model (core/cost.py).

Inference only: training lives in specserve.training.decision, the safetensors files in
specserve.runtime.stopper. Labels are logged from our own runs (`specserve train-stopper`): 1 when the
drafted token equals the target's greedy choice after the same prefix, else 0. Every drafted token gets
a label, including those after a rejection: the policy is asked about every token too, before anything
is verified.

Worked example of the features: draft probabilities (0.5, 0.3, 0.2) over a 3-token vocabulary give
[1.0297, 0.5, 0.3, 0.2, 0, 0, 0, 0, 0, 0, 0] (entropy in nats, then the top 10, zero-padded).
"""

from __future__ import annotations

import torch
from torch import nn

NUM_TOP_PROBS = 10
NUM_FEATURES = 1 + NUM_TOP_PROBS  # entropy, then the top-10 probabilities
HIDDEN_SIZE = 44  # the paper's 11 -> 44 -> 1


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
