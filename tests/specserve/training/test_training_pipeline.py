"""`specserve train-draft` end to end on a tiny target, through real Ray Data and Ray Train.

Builds every data stage from real offline sources (self answers, dummy conversations, stdlib), trains a
few steps, then resumes from the checkpoint to a larger step count and loads the result as a draft.
"""

from __future__ import annotations

import json

import pytest
import torch

from specserve.glide import load_glide
from specserve.models import load_causal_lm
from specserve.training.corpus import Source
from specserve.training.data import ANSWERS, DONE, FEATURES, MANIFEST, build_training_data, init_ray
from specserve.training.settings import DataSettings, TrainSettings
from specserve.training.trainer import CHECKPOINTS, LOG, SUMMARY, train_draft

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    init_ray(num_cpus=2)  # the pipeline's own start-up, with its GCS wait
    yield
    ray.shutdown()


def test_data_then_training_then_resume(ray_local, tiny_target_dir, tmp_path) -> None:
    import ray.data

    built_with = DataSettings(
        out_dir=tmp_path / "data",
        model_dir=tiny_target_dir,
        seq_len=32,
        sources=(Source.SELF, Source.DUMMY, Source.STDLIB),
        self_prompts=3,
        answer_tokens=6,
        answer_batch=2,
        dummy_conversations=4,
        stdlib_chars=3000,
        feature_batch=4,
    )
    data = build_training_data(built_with, log=lambda _: None)
    assert (data / ANSWERS / DONE).is_file() and (data / FEATURES / DONE).is_file()
    manifest = json.loads((data / MANIFEST).read_text())
    assert set(manifest["stage_seconds"]) == {ANSWERS, FEATURES}
    # `train-draft` over this data with its own defaults skips every stage and keeps the record of
    # what built the rows
    build_training_data(DataSettings(out_dir=data, model_dir=tiny_target_dir), log=lambda _: None)
    assert json.loads((data / MANIFEST).read_text())["settings"] == manifest["settings"]
    assert manifest["settings"]["stdlib_chars"] == 3000
    rows = ray.data.read_parquet(str(data / FEATURES)).take_all()
    assert {row["source"] for row in rows} == {"self", "dummy", "stdlib"}
    assert all(row["target_k"].shape == (2, 32, 16) for row in rows)  # tiny target: 2 kv heads x 16

    settings = TrainSettings(
        data_dir=data,
        out_dir=tmp_path / "draft",
        model_dir=tiny_target_dir,
        draft_vocab_size=64,
        batch_size=2,
        steps=4,
        checkpoint_every=2,
        log_every=2,
        num_threads=1,
    )
    train_draft(settings, log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "draft" / CHECKPOINTS).iterdir()) == [
        "step-000002",
        "step-000004",
    ]
    from dataclasses import replace

    train_draft(replace(settings, steps=6), log=lambda _: None)  # resumes at step 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "draft" / LOG).read_text().splitlines()]
    assert steps == [2, 4, 6]
    summary = json.loads((tmp_path / "draft" / SUMMARY).read_text())
    assert summary["data"]["rows"] == len(rows)
    target = load_causal_lm(tiny_target_dir)
    draft = load_glide(tmp_path / "draft", target)
    assert draft.config.draft_vocab_size == 64
    assert not torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight[draft.draft_token_ids])
