"""Settings of the draft-training pipeline: one object for data generation, one for training."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve.errors import InvalidArgument
from specserve.training.corpus import Source


@dataclass(frozen=True)
class DataSettings:
    out_dir: Path
    model_dir: Path  # the frozen target
    target_layer: int = -1  # whose K/V the draft reads (the GliDe default: the last)
    seq_len: int = 256  # tokens per training row (documents are packed)
    sources: tuple[Source, ...] = (Source.SELF, Source.DUMMY, Source.PYDOC, Source.STDLIB)
    self_prompts: int = 512  # written prompts the target answers (self-distillation)
    answer_tokens: int = 128  # max new tokens per answer
    answer_batch: int = 32  # prompts per batched generate call
    dummy_conversations: int = 500
    pydoc_chars: int = 600_000
    stdlib_chars: int = 400_000
    feature_batch: int = 8  # rows per target forward when extracting K/V and labels
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 16 or self.answer_tokens < 1 or self.answer_batch < 1 or self.feature_batch < 1:
            raise InvalidArgument("seq_len >= 16 and positive batch sizes are required")
        if not self.sources:
            raise InvalidArgument("choose at least one training source")


@dataclass(frozen=True)
class TrainSettings:
    data_dir: Path
    out_dir: Path
    model_dir: Path  # the target whose embedding (shared, frozen) and LM head seed the draft
    cross_attention: bool = True  # False = the vanilla ablation: same block, no cross-attention
    draft_vocab_size: int | None = 8192  # reduced LM head, the most frequent target labels; None = full
    intermediate_size: int | None = None  # None = the target's
    block_size: int = 5  # block-wise cross-attention mask
    # Start the block as the target layer it reads (same geometry). Off: in our run (docs/training.md) it
    # trained slower than a random block (agreement 0.29 vs 0.33 at step 120).
    init_from_target_layer: bool = False
    # Keep the reduced LM head at the target's own rows: half the draft's parameters stop adapting to
    # (and memorising) a small training set; the block learns to land in the target's output space.
    freeze_head: bool = False
    batch_size: int = 8  # rows per step per worker
    steps: int = 2000
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_fraction: float = 0.025
    grad_clip: float = 1.0
    # bf16 autocast for the forward (fp32 master weights and optimizer): faster on CPUs with
    # AVX512-BF16, and the usual choice on GPUs; skipped on a CPU without a bf16 kernel (device.py).
    bf16: bool = True
    export_dtype: str = "bfloat16"  # the final draft's stored weights (checkpoints stay fp32)
    checkpoint_every: int = 200
    log_every: int = 20
    num_workers: int = 1  # Ray Train workers (data parallel)
    cpus_per_worker: int = 1
    num_threads: int | None = None  # torch threads per worker; None = all cores of the machine
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict)  # recorded with the checkpoint, not used

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.checkpoint_every < 1 or self.log_every < 1:
            raise InvalidArgument("steps, batch_size, checkpoint_every and log_every must be positive")
        if not 0 <= self.warmup_fraction < 1 or self.lr <= 0:
            raise InvalidArgument("need 0 <= warmup_fraction < 1 and lr > 0")
        if self.export_dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidArgument("export_dtype must be float32, bfloat16 or float16")
        if self.num_workers < 1 or self.cpus_per_worker < 1:
            raise InvalidArgument("num_workers and cpus_per_worker must be positive")
