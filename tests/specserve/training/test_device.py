"""The training pipeline's device: each command runs end to end with `--device cpu`, a training step keeps
every tensor on the device of its target and batch, and a GPU this machine lacks is one early error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.training import eagle as eagle_training
from specserve.training import generation
from specserve.training.device import bf16_autocast, device_record, parse_device, to_device, usable_device
from specserve.training.distill import cli as distill_cli
from specserve.training.distill import glide_loss
from specserve.training.distill.feature_set import FeatureSet
from specserve.training.distill.glide_loss import step_loss
from specserve.training.distill.loop import train
from specserve.training.distill.run_log import LOG, RUN, SUMMARY
from specserve.training.distill.settings import DistillSettings
from specserve.training.distill.starting_draft import new_draft, new_eagle_draft
from specserve.training.generation import ANSWERS, INSTRUCT, GenerationSettings, read_stage


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """SPECSERVE_CACHE_DIR for the commands: their held-out answers stay out of the user's cache."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSERVE_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def generated(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """`python -m specserve.training.generation --device cpu`, as small as it goes: 8 self-instruct
    requests, then one shard of 2 answers, 4 new tokens each."""
    out = tmp_path_factory.mktemp("generated")
    generation.main(
        [
            *("--out", str(out), "--model-dir", str(tiny_target_dir), "--device", "cpu"),
            *("--shard-size", "2", "--batch-size", "2", "--max-new-tokens", "4", "--max-shards", "1"),
            *("--subjects-per-kind", "1", "--docstrings", "1", "--dtype", "float32", "--dynamic-cache"),
            *("--threads", "1"),
        ]
    )
    return out


@pytest.fixture(scope="module")
def featured(tiny_target_dir: Path, generated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m specserve.training.distill features --device cpu` over the generated shards."""
    out = tmp_path_factory.mktemp("features")
    distill_cli.main(
        [
            *("features", "--data", str(generated), "--out", str(out), "--model-dir", str(tiny_target_dir)),
            *("--device", "cpu", "--top-k", "4", "--threads", "1"),
        ]
    )
    return out


def test_the_generation_command_runs_on_the_cpu(generated: Path) -> None:
    assert json.loads((generated / "settings.json").read_text())["device"] == "cpu"
    assert len(read_stage(generated / INSTRUCT)) > 0
    answers = read_stage(generated / ANSWERS)
    assert len(answers) == 2 and 0 < int(answers.answer_lengths.max()) <= 4


def test_the_features_command_runs_on_the_cpu(featured: Path, generated: Path) -> None:
    data = FeatureSet.load(featured, hidden=True)
    assert len(data) == len(read_stage(generated / INSTRUCT)) + len(read_stage(generated / ANSWERS))
    assert sorted(data.kv) == [0, 1] and data.topk_ids.shape[1] == 4 and data.hidden is not None


def test_the_train_command_runs_on_the_cpu_and_records_its_device(
    featured: Path, tiny_target_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "draft"
    distill_cli.main(
        [
            *("train", "--features", str(featured), "--out", str(out), "--model-dir", str(tiny_target_dir)),
            *("--device", "cpu", "--steps", "1", "--batch-size", "2", "--draft-vocab-size", "64"),
            *("--eval-per-category", "1", "--eval-max-new-tokens", "4", "--threads", "1"),
            *("--weight-decay", "0.01"),
        ]
    )
    # what comes back from a run on any device
    for name in ("model.safetensors", "config.json", SUMMARY, LOG, "training.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / RUN).read_text())["device"] == "cpu"
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["device"] == "cpu" and summary["settings"]["device"] == "cpu"
    assert summary["settings"]["weight_decay"] == 0.01  # the flag reaches the optimizer's settings
    assert [json.loads(line)["step"] for line in (out / LOG).read_text().splitlines()] == [0, 1, 1]


def _kd_loss_on_meta(scores, topk_index, topk_probs, labels, kd_weight, ce_weight):
    """Stands in for `kd.kd_loss`, which branches on its data (`rows.any()`), something meta tensors do
    not have; it makes its own tensors with *_like, so they follow its inputs, whose device this checks."""
    assert {t.device.type for t in (scores, topk_index, topk_probs, labels)} == {"meta"}
    loss = (scores.float().logsumexp(-1) * topk_probs.float().sum(-1)).mean()
    return loss, loss.detach(), loss.detach()


def _step(kind: str, device: torch.device, target_dir: Path, features: Path, out: Path):
    """One training step's loss, metrics and trainable parameters, the target and batch on `device`."""
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False).to(device)
    settings = DistillSettings(features=features, out_dir=out, kind=kind, draft_vocab_size=64, bf16=False)
    if kind == "eagle":
        data = FeatureSet.load(features, layers=[], hidden=True)
        eagle_draft = new_eagle_draft(settings, target, data)
        batch = to_device(data.batch([0, 1], []), device)
        loss, metrics = eagle_training.eagle_step_loss(eagle_draft, batch, 3, 0.8, 1.0, 1.0, bf16=False)
        return loss, metrics, [p for p in eagle_draft.parameters() if p.requires_grad]
    data = FeatureSet.load(features)
    glide_draft = new_draft(settings, target, data)
    loss, metrics = step_loss(glide_draft, to_device(data.batch([0, 1], [0, 1]), device), settings)
    return loss, metrics, [p for p in glide_draft.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", ["glide", "eagle"])
def test_a_training_step_keeps_every_tensor_where_the_target_is(
    kind: str, featured: Path, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On "meta" (tensors without data) mixing in a tensor made on the CPU raises, as it does on a GPU: a
    step that runs there makes its masks, indices and losses on its target's and batch's device."""
    from torch.fx.experimental import _config as fx_config

    monkeypatch.setattr(glide_loss, "kd_loss", _kd_loss_on_meta)
    monkeypatch.setattr(eagle_training, "kd_loss", _kd_loss_on_meta)
    meta = torch.device("meta")
    # A boolean mask selects a data-dependent number of positions; on meta, assume every one.
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        loss, metrics, trainable = _step(kind, meta, tiny_target_dir, featured, tmp_path)
        loss.backward()
    assert trainable and all(p.grad is not None and p.grad.device == meta for p in trainable)
    assert loss.device == meta and {m.device for m in metrics.values()} == {meta}


def test_device_names_are_checked_where_settings_are_made() -> None:
    assert [str(parse_device(name)) for name in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]
    for bad in ("tpu", "cuda:x", "meta", ""):
        with pytest.raises(InvalidArgument, match="cpu, cuda or cuda:N"):
            parse_device(bad)
    with pytest.raises(InvalidArgument):
        DistillSettings(features=Path("f"), out_dir=Path("o"), device="gpu")
    with pytest.raises(InvalidArgument):
        GenerationSettings(device="cuda:one")


def test_a_gpu_this_machine_lacks_fails_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No model directory, no features: the device check comes first, so neither is looked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FailedPrecondition, match="no CUDA GPU"):
        usable_device("cuda:0")
    missing = tmp_path / "no-model"
    settings = DistillSettings(features=tmp_path / "no-features", out_dir=tmp_path / "draft", device="cuda")
    with pytest.raises(FailedPrecondition, match="--device cpu"):
        train(settings, missing, tmp_path / "cache")
    with pytest.raises(FailedPrecondition):
        distill_cli.main(
            ["train", "--features", str(tmp_path), "--out", str(tmp_path / "draft"), "--device", "cuda"]
        )
    with pytest.raises(FailedPrecondition):
        distill_cli.main(
            ["features", "--data", str(tmp_path), "--out", str(tmp_path / "f"), "--device", "cuda"]
        )
    with pytest.raises(FailedPrecondition):
        generation.main(["--out", str(tmp_path / "gen"), "--model-dir", str(missing), "--device", "cuda"])
    with pytest.raises(InvalidArgument, match="--device cuda"):
        generation.main(["--out", str(tmp_path / "gen"), "--workers", "2", "--device", "cuda:1"])
    assert not any(tmp_path.iterdir())  # nothing written


def test_bf16_autocast_runs_only_where_a_bf16_kernel_makes_it_faster(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # AVX-512
    with bf16_autocast(cpu, True):
        assert torch.is_autocast_enabled("cpu")
    with bf16_autocast(cpu, False):
        assert not torch.is_autocast_enabled("cpu")
    assert device_record(cpu)["cpu_bf16_autocast"] == "yes"
    # an AVX2-only CPU: torch would emulate bf16 ~4x slower; the step runs in float32 and says so
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with bf16_autocast(cpu, True):
        assert not torch.is_autocast_enabled("cpu")
    assert device_record(cpu)["cpu_bf16_autocast"] == "no, float32"
