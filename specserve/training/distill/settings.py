"""The settings of one distillation run (`distill train`): its data, its schedule, the draft it trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve.errors import InvalidArgument
from specserve.training.device import parse_device

DEFAULT_BLOCKS = 2  # a draft trained from scratch: two blocks, reading layers spread through the target


@dataclass(frozen=True)
class DistillSettings:
    features: Path
    out_dir: Path
    fraction: float = 1.0  # of the feature set's sequences (the data-scaling curve)
    steps: int = 1000
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    warmup_fraction: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 1.0
    draft_vocab_size: int = 8192  # rows of the reduced head (the most frequent target labels)
    num_layers: int = DEFAULT_BLOCKS  # draft blocks
    # the target layer each block reads; None = spread through the target's depth (glide/config.py)
    block_target_layers: tuple[int, ...] | None = None
    block_size: int = 5
    init_from: Path | None = None  # start from a trained draft (its head ids are kept)
    bf16: bool = True
    eval_every: int = 100
    log_every: int = 10
    checkpoint_every: int = 100
    eval_per_category: int = 5  # MT-Bench first turns per category, as `eval-draft`
    eval_max_new_tokens: int = 128
    threads: int | None = None
    seed: int = 0
    # "glide" (reads the target's K/V) or "eagle" (reads its final hidden states: specserve/eagle)
    kind: str = "glide"
    unroll_steps: int = 3  # eagle: training-time test, steps of the draft reading its own outputs
    step_decay: float = 0.8  # eagle: weight of step j's loss is step_decay**j
    train_head: bool = False  # eagle: also train the reduced head (else it stays the target's rows)
    # eagle: half-width of the uniform noise added to the target's features in training (EAGLE's
    # augmentation); 0 = none. The final normed state of the default model has an RMS of about 2.
    feature_noise: float = 0.0
    # eagle: target decoder layers whose outputs are the draft's fused input; () = the final normed state
    feature_layers: tuple[int, ...] = ()
    # "cpu", "cuda" or "cuda:N": where the target, the draft and every batch live (bf16 autocast on either)
    device: str = "cpu"
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_device(self.device)  # the name only: whether this machine has the GPU is `train`'s check
        if self.feature_noise < 0 or (self.feature_noise > 0 and self.kind != "eagle"):
            raise InvalidArgument("feature_noise is a non-negative half-width, for hidden-state drafts only")
        if self.weight_decay < 0:
            raise InvalidArgument("weight_decay must be non-negative")
