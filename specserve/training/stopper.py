"""`specserve train-stopper`: log drafted tokens from real runs, train the `decision` stopper on them.

Logging runs the real speculative loop (the GliDe or the hidden-state drafter, `--draft`, a chain of
`depth` tokens, greedy) on prompts written for this project (training/prompts.py, never a benchmark's).
For every drafted token it keeps the draft's features (core/decision.py) and whether the target's greedy
choice after the same prefix equals it. The target's choices come from the verifier's own forward over the
chain, so nothing runs twice: a thin runner wrapper keeps the last logits it returned.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.decision import decision_features
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import DraftTree, VerifyOutcome
from specserve.core.stopping import DraftStep, FixedPolicy, StopSettings
from specserve.drafts import STOPPER_DRAFTS, DraftKind, stopper_dir
from specserve.eagle.drafter import EagleDrafter
from specserve.errors import InvalidArgument
from specserve.glide.drafter import GlideDrafter
from specserve.runtime.drafter import DraftShape
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.runner import ModelRunner
from specserve.runtime.stopper import save_decision_model
from specserve.runtime.target import LocalVerifier
from specserve.training.decision import DecisionTrainSettings, train_decision_model
from specserve.training.prompts import written_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopperLogSettings:
    num_prompts: int = 60
    max_new_tokens: int = 64
    depth: int = 6  # chain length drafted per round: deep enough to see where drafts go wrong
    prompt_seed: int = 1  # train-draft uses seed 0 for its self-distillation prompts
    draft: DraftKind = DraftKind.GLIDE  # whose tokens are logged: a stopper judges one draft's

    def __post_init__(self) -> None:
        if self.draft not in STOPPER_DRAFTS:
            kinds = " or ".join(STOPPER_DRAFTS)
            raise InvalidArgument(f"a stopper is trained on {kinds} drafts, not {self.draft}")


def _chain_drafter(engine, cache: PositionalKVCache, capacity: int, settings: StopperLogSettings):
    """The shipped draft of `settings.draft`, drafting chains of `settings.depth` tokens."""
    shape = DraftShape(settings.depth)
    if settings.draft is DraftKind.EAGLE:
        return EagleDrafter(engine.eagle_draft, cache, capacity, shape)
    return GlideDrafter(engine.glide_draft, cache, capacity, shape)


class _LastLogitsRunner:
    """A ModelRunner that remembers the logits of its last forward (the verifier's, here)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.last_logits: torch.Tensor | None = None  # [n, V]

    def new_cache(self, capacity: int) -> PositionalKVCache:
        return self.runner.new_cache(capacity)

    def forward(self, cache, token_ids, parent_ids=None, last_only=False) -> torch.Tensor:
        logits = self.runner.forward(cache, token_ids, parent_ids, last_only)
        self.last_logits = logits
        return logits


class _RecordingFixedPolicy(FixedPolicy):
    """The fixed policy, keeping the features of every spine token of the current round."""

    def __init__(self, depth: int) -> None:
        super().__init__(StopSettings(fixed_depth=depth))
        self.round_features: list[torch.Tensor] = []  # [11] each

    def should_stop(self, step: DraftStep) -> bool:
        self.round_features.append(decision_features(step.logits))
        return False


class _LabellingVerifier:
    """Verifies as LocalVerifier does, then labels each chain token: target argmax at its parent == it."""

    def __init__(self, verifier: LocalVerifier, runner: _LastLogitsRunner, policy: _RecordingFixedPolicy):
        self.verifier, self.runner, self.policy = verifier, runner, policy
        self.features: list[torch.Tensor] = []
        self.labels: list[float] = []

    def prefill(self, prompt_ids: Sequence[int], round_seed: int) -> int:
        return self.verifier.prefill(prompt_ids, round_seed)

    def resume(self, token_ids: Sequence[int]) -> None:
        self.verifier.resume(token_ids)

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        outcome = self.verifier.verify(draft, round_seed)
        assert self.runner.last_logits is not None and draft.tree.is_chain()
        target_choice = self.runner.last_logits.argmax(-1).tolist()  # [N] after each node
        drafted = draft.tree.token_ids[1:]
        features, self.policy.round_features = self.policy.round_features, []
        for i, (token, feature) in enumerate(zip(drafted, features, strict=True)):
            self.features.append(feature)
            self.labels.append(float(token == target_choice[i]))
        return outcome

    def release(self) -> None:
        self.verifier.release()


def log_stopper_data(engine, settings: StopperLogSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the chosen drafter on `num_prompts` written prompts -> (features [n, 11], labels [n])."""
    runner = _LastLogitsRunner(engine.target_runner)
    features: list[torch.Tensor] = []
    labels: list[float] = []
    prompts = written_prompts(settings.num_prompts, seed=settings.prompt_seed)
    for prompt in tqdm(prompts, desc="logging drafted tokens", unit="prompt"):
        prompt_ids = engine.encode_prompt(prompt)
        capacity = len(prompt_ids) + settings.max_new_tokens + settings.depth + 2
        policy = _RecordingFixedPolicy(settings.depth)
        verifier = _LabellingVerifier(LocalVerifier(runner, capacity), runner, policy)  # type: ignore[arg-type]
        drafter = _chain_drafter(engine, verifier.verifier.cache, capacity, settings)
        drafter.stop_policy = policy
        finish = FinishChecker(settings.max_new_tokens, engine.eos_token_ids)
        try:
            speculative_generate(prompt_ids, verifier, drafter, request_seed=0, finish=finish)  # greedy
        finally:
            verifier.release()
            drafter.release()
        features.extend(verifier.features)
        labels.extend(verifier.labels)
    return torch.stack(features), torch.tensor(labels)


def train_stopper(
    engine,
    out_dir: Path,
    log_settings: StopperLogSettings | None = None,
    train_settings: DecisionTrainSettings | None = None,
) -> dict:
    """Logs, trains, writes out_dir/{model.safetensors, stopper.json}; returns the json record."""
    log_settings = log_settings or StopperLogSettings()
    train_settings = train_settings or DecisionTrainSettings()
    start = time.perf_counter()
    features, labels = log_stopper_data(engine, log_settings)
    log_s = time.perf_counter() - start
    model, report = train_decision_model(features, labels, train_settings)
    record = {
        **asdict(report),
        "num_logged_tokens": len(labels),
        "log_settings": asdict(log_settings),
        "drafter": f"{log_settings.draft.value} (shipped draft), chain, greedy; label = target argmax after "
        "the same prefix",
        "prompts": "specserve.training.prompts.written_prompts",
        "log_seconds": round(log_s, 1),
        "train_seconds": round(time.perf_counter() - start - log_s, 1),
    }
    save_decision_model(model, out_dir, record)
    logger.info("stopper: held-out AUC %.3f on %d tokens", report.held_out_auc, report.num_held_out)
    return record


def run_train_stopper_command(args) -> int:
    from specserve.engine import Engine
    from specserve.settings import EngineSettings

    draft = DraftKind(args.draft)
    settings = EngineSettings.from_env(
        model=args.model, model_dir=args.model_dir, glide_dir=args.glide_dir, eagle_dir=args.eagle_dir
    )
    engine = Engine(settings)
    record = train_stopper(
        engine,
        args.out or stopper_dir(draft),
        StopperLogSettings(args.prompts, args.max_new_tokens, args.depth, args.prompt_seed, draft),
        DecisionTrainSettings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed),
    )
    summary = {k: record[k] for k in ("held_out_auc", "held_out_accuracy", "num_logged_tokens", "num_train")}
    print(json.dumps(summary))
    return 0
