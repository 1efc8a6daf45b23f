"""Distillation runs of each kind: a run logs its steps and evaluations and saves a draft that reads the
layers it was given, and a stopped run resumes to the bits of one that never stopped."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specserve.eagle.config import fused_feature_layers
from specserve.eagle.model import is_eagle_dir, load_eagle
from specserve.glide import load_glide
from specserve.training.distill.feature_extraction import extract_features
from specserve.training.distill.loop import train
from specserve.training.distill.run_log import CHECKPOINTS, LOG
from specserve.training.distill.settings import DistillSettings
from specserve.training.evaluate import evaluate_draft


def tiny_run(features: Path, tmp_path: Path, **overrides: object) -> DistillSettings:
    """A distillation run (GliDe unless `kind` says otherwise) small enough for a unit test, into
    tmp_path / "draft"."""
    return DistillSettings(
        features=features,
        out_dir=tmp_path / "draft",
        batch_size=2,
        draft_vocab_size=64,
        bf16=False,
        eval_per_category=1,
        eval_max_new_tokens=4,
        **overrides,  # type: ignore[arg-type]
    )


def eagle_run(features: Path, tmp_path: Path, **overrides: object) -> DistillSettings:
    """A hidden-state distillation run small enough for a unit test, into tmp_path / "draft"."""
    return tiny_run(features, tmp_path, kind="eagle", **overrides)


def test_training_logs_each_step_and_eval_and_saves_the_draft(tiny_target_dir, features, tmp_path) -> None:
    settings = tiny_run(features, tmp_path, steps=2, log_every=1)  # the last step also evaluates, saves
    messages: list[str] = []
    train(settings, tiny_target_dir, tmp_path / "cache", log=messages.append)
    draft_config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert draft_config["block_target_layers"] == [0, 1]  # the default: two blocks spread over the target
    records = [json.loads(line) for line in (tmp_path / "draft" / LOG).read_text().splitlines()]
    assert [(r["step"], "eval" in r) for r in records] == [(0, True), (1, False), (2, False), (2, True)]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    said = [m.split(":")[0] if m.startswith("eval") else " ".join(m.split()[:2]) for m in messages]
    assert said[-4:] == ["eval step 0", "step 1/2", "step 2/2", "eval step 2"], messages
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_a_draft_reading_a_chosen_layer_trains_on_features_of_that_layer_alone(
    tiny, tiny_target_dir, generated, tmp_path
) -> None:
    model, _ = tiny
    extract_features(model, generated, tmp_path / "features", layers=(0,), top_k=4, log=lambda _: None)
    settings = tiny_run(tmp_path / "features", tmp_path, steps=1, num_layers=1, block_target_layers=(0,))
    train(settings, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
    draft = load_glide(tmp_path / "draft", model)
    assert draft.config.layers_read == (0,) and draft.config.feed_layers == [0]
    agreement = evaluate_draft(model, draft, [[1, 2, 3, 4, 5, 6, 7, 8]], [2], pad_id=0, progress=False)
    assert sum(agreement.scored) > 0


def test_a_distillation_run_trains_evaluates_and_saves_a_hidden_state_draft(
    tiny, tiny_target_dir, features, tmp_path
) -> None:
    model, _ = tiny
    settings = eagle_run(features, tmp_path, steps=2, log_every=1)
    train(settings, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
    assert is_eagle_dir(tmp_path / "draft")
    records = [json.loads(line) for line in (tmp_path / "draft" / LOG).read_text().splitlines()]
    assert [(r["step"], "eval" in r) for r in records] == [(0, True), (1, False), (2, False), (2, True)]
    assert len(records[-1]["eval"]["by_lag"]) == 5
    draft = load_eagle(tmp_path / "draft", model)
    assert draft.config.draft_vocab_size == 64
    np.testing.assert_array_equal(
        np.sort(draft.draft_token_ids.numpy()), np.unique(draft.draft_token_ids.numpy())
    )


@pytest.mark.parametrize("feature_noise", [0.0, 0.5])
def test_a_stopped_run_resumes_to_the_same_weights(
    tiny_target_dir, features, tmp_path, feature_noise
) -> None:
    """Stopped after its step-2 checkpoint and started again, a run ends with the bits of one that never
    stopped: the batch of a step, the optimizer's moments, the schedule and the feature noise all come
    back."""
    settings = eagle_run(features, tmp_path, steps=4, checkpoint_every=2, feature_noise=feature_noise)
    checkpoints = tmp_path / "draft" / CHECKPOINTS
    train(settings, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
    straight = load_file(str(checkpoints / "step-000004" / "model.safetensors"))
    shutil.rmtree(checkpoints / "step-000004")
    logged: list[str] = []
    train(settings, tiny_target_dir, tmp_path / "cache", log=logged.append)
    assert any("resumed from step-000002 at step 2" in line for line in logged)
    resumed = load_file(str(checkpoints / "step-000004" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), name
    # and training moved the weights at all (a run that changed nothing would also be "equal")
    first = load_file(str(checkpoints / "step-000002" / "model.safetensors"))
    assert not torch.equal(first["fc.weight"], straight["fc.weight"])
    if feature_noise:  # and the noise reached the draft: the same run without it ends elsewhere
        plain = eagle_run(features, tmp_path / "plain", steps=4, checkpoint_every=2)
        train(plain, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
        noiseless = load_file(
            str(tmp_path / "plain" / "draft" / CHECKPOINTS / "step-000004" / "model.safetensors")
        )
        assert not torch.equal(noiseless["fc.weight"], straight["fc.weight"])


def test_a_fused_run_reads_the_layers_it_names_and_keeps_them_in_its_config(
    tiny, tiny_target_dir, features, tmp_path
) -> None:
    """EAGLE-3's input: the features hold layer outputs (`h.<layer>`, by default a low, middle and high
    layer), a run names the ones it reads, and the saved draft carries them, its fuse sized k * H."""
    model, _ = tiny
    shard = next(features.glob("*.npz"))
    with np.load(shard) as z:
        stored = sorted(int(name[2:]) for name in z.files if name.startswith("h."))
    assert stored == list(fused_feature_layers(model.config.num_hidden_layers))
    settings = eagle_run(features, tmp_path, steps=2, feature_layers=(0, 1))
    train(settings, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
    draft = load_eagle(tmp_path / "draft", model)
    hidden = model.config.hidden_size
    assert draft.config.feature_layers == (0, 1)
    assert draft.fuse is not None and tuple(draft.fuse.weight.shape) == (hidden, 2 * hidden)
    # a layer the features do not hold is a clear error, not a silent fallback to the final state
    with pytest.raises(FileNotFoundError, match=r"h\.5"):
        train(
            eagle_run(features, tmp_path / "other", steps=1, feature_layers=(5,)),
            tiny_target_dir,
            tmp_path / "cache",
            log=lambda _: None,
        )
