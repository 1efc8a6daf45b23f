"""Hidden-state draft training: the stored features are what the target's LM head reads, the draft's
inputs and labels line up by hand, unrolled training learns, and a run trains, evaluates and saves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.eagle.model import build_eagle, is_eagle_dir, load_eagle
from specserve.models import load_tokenizer
from specserve.training.eagle import (
    eagle_step_loss,
    held_out_hidden,
    noisy_features,
    score_eagle,
    shifted_inputs,
)
from specserve.training.features import IGNORE
from specserve.training.generation import ANSWERS, GenerationSettings, read_stage, run_stage
from specserve.training.prompt_set import Prompt, user

PROMPTS = [Prompt("test", user(f"Tell me about topic number {i}.")) for i in range(7)]
SETTINGS = GenerationSettings(
    shard_size=4, batch_size=2, max_new_tokens=6, dtype="float32", static_cache=False
)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="module")
def features(tiny, tmp_path_factory) -> Path:
    from specserve.training.distill import extract_features

    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("eagle-data")
    run_stage(model, tokenizer, root / "gen" / ANSWERS, lambda: list(PROMPTS), SETTINGS, log=lambda _: None)
    extract_features(model, root / "gen", root / "features", top_k=4, log=lambda _: None)
    return root


def test_stored_hidden_state_is_the_normed_vector_the_lm_head_reads(tiny, features) -> None:
    from specserve.training.distill import FeatureSet

    model, _ = tiny
    data = FeatureSet.load(features / "features", layers=[], hidden=True)
    prompt, answer = read_stage(features / "gen" / ANSWERS).sequences()[0]
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        last_layer = out.hidden_states[-1][0]  # transformers: after the final norm
        # by hand: the last decoder layer's output, normed with the final RMSNorm
        pre = model.model.layers[-1](
            out.hidden_states[-2],
            position_embeddings=model.model.rotary_emb(
                out.hidden_states[-2], torch.arange(ids.shape[1])[None]
            ),
            attention_mask=None,
        )
        pre = pre[0] if isinstance(pre, tuple) else pre
    stored = torch.from_numpy(data.hidden[: ids.shape[1]]).float()  # [L, H]
    normed = model.model.norm(pre[0])
    torch.testing.assert_close(stored, normed, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(stored, last_layer, atol=2e-2, rtol=1e-2)
    # the LM head over the stored state gives the target's own argmax at every position
    assert torch.equal(model.lm_head(stored).argmax(-1), out.logits[0].argmax(-1))


def test_the_drafts_position_t_reads_h_t_and_x_t_plus_1_and_learns_x_t_plus_2() -> None:
    hidden = torch.arange(5.0)[None, :, None].expand(1, 5, 3).half()  # h[t] = t
    batch = {
        "hidden": hidden,
        "input_ids": torch.tensor([[10, 11, 12, 13, 14]]),
        "topk_ids": torch.tensor([[[20], [21], [22], [23], [24]]]),  # target's top-1 for x[t + 1]
        "topk_probs": torch.ones(1, 5, 1).half(),
        "loss_mask": torch.tensor([[False, True, True, True, False]]),
    }
    view = shifted_inputs(batch)
    assert view["features"][0, :, 0].tolist() == [0, 1, 2, 3]  # h[t]
    assert view["input_ids"].tolist() == [[11, 12, 13, 14]]  # x[t + 1]
    assert view["topk_ids"][0, :, 0].tolist() == [21, 22, 23, 24]  # the label of x[t + 2]
    assert view["loss_mask"].tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("feature_layers", [(), (0, 1)], ids=["final-hidden", "fused"])
def test_unrolled_training_raises_agreement_on_what_it_saw(tiny, features, feature_layers) -> None:
    from specserve.training.distill import FeatureSet

    model, _ = tiny
    data = FeatureSet.load(features / "features", layers=[], hidden=True, output_layers=feature_layers)
    assert data.hidden is not None
    assert data.hidden.shape[1] == model.config.hidden_size * max(1, len(feature_layers))
    torch.manual_seed(0)
    draft = build_eagle(model, draft_vocab_size=None, feature_layers=feature_layers)
    draft = draft.float().train().requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    batch = data.batch(list(range(len(data))), [])
    losses = []
    for _ in range(40):
        loss, metrics = eagle_step_loss(draft, batch, 3, 0.8, 1.0, 1.0, bf16=False)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(metrics["loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    draft.eval()
    sequences = [list(data.tokens[s : s + n]) for s, n in zip(data.starts, data.lengths, strict=True)]
    batches = held_out_hidden(
        model, sequences, list(data.prompt_lengths), pad_id=0, output_layers=feature_layers
    )
    agreement = score_eagle(draft, batches)
    assert agreement.by_lag[0] > 0.5 and all(n > 0 for n in agreement.scored)
    assert all(int((b["labels"] != IGNORE).sum()) > 0 for b in batches)


def tiny_run(features: Path, tmp_path: Path, **overrides: object):
    """A hidden-state distillation run small enough for a unit test, into tmp_path / "draft"."""
    from specserve.training.distill import DistillSettings

    return DistillSettings(
        features=features / "features",
        out_dir=tmp_path / "draft",
        kind="eagle",
        batch_size=2,
        draft_vocab_size=64,
        bf16=False,
        eval_per_category=1,
        eval_max_new_tokens=4,
        **overrides,  # type: ignore[arg-type]
    )


def test_a_distillation_run_trains_evaluates_and_saves_a_hidden_state_draft(
    tiny, tiny_target_dir, features, tmp_path
) -> None:
    from specserve.training.distill import LOG, train

    model, _ = tiny
    settings = tiny_run(features, tmp_path, steps=2, log_every=1)
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


def test_feature_noise_is_bounded_uniform_and_a_function_of_seed_and_step() -> None:
    features = torch.randn(4, 64, 32)  # [B, S, H]
    assert noisy_features(features, 0.0, seed=0, step=3) is features
    noisy = noisy_features(features, 0.25, seed=0, step=3)
    delta = noisy - features
    assert float(delta.abs().max()) <= 0.25 + 1e-6
    assert float(delta.abs().max()) > 0.24  # the whole width is used, not a sliver of it
    assert abs(float(delta.abs().mean()) - 0.125) < 0.01  # |U(-w, w)| has mean w / 2
    assert abs(float(delta.mean())) < 0.01  # centred: the features keep their scale
    assert torch.equal(noisy, noisy_features(features, 0.25, seed=0, step=3))
    assert not torch.equal(noisy, noisy_features(features, 0.25, seed=0, step=4))
    assert not torch.equal(noisy, noisy_features(features, 0.25, seed=1, step=3))


@pytest.mark.parametrize("feature_noise", [0.0, 0.5])
def test_a_stopped_run_resumes_to_the_same_weights(
    tiny_target_dir, features, tmp_path, feature_noise
) -> None:
    """Stopped after its step-2 checkpoint and started again, a run ends with the bits of one that never
    stopped: the batch of a step, the optimizer's moments, the schedule and the feature noise all come
    back."""
    from safetensors.torch import load_file

    from specserve.training.distill import CHECKPOINTS, train

    settings = tiny_run(features, tmp_path, steps=4, checkpoint_every=2, feature_noise=feature_noise)
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
        plain = tiny_run(features, tmp_path / "plain", steps=4, checkpoint_every=2)
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
    from specserve.eagle.config import fused_feature_layers
    from specserve.training.distill import train

    model, _ = tiny
    shard = next((features / "features").glob("*.npz"))
    with np.load(shard) as z:
        stored = sorted(int(name[2:]) for name in z.files if name.startswith("h."))
    assert stored == list(fused_feature_layers(model.config.num_hidden_layers))
    settings = tiny_run(features, tmp_path, steps=2, feature_layers=(0, 1))
    train(settings, tiny_target_dir, tmp_path / "cache", log=lambda _: None)
    draft = load_eagle(tmp_path / "draft", model)
    hidden = model.config.hidden_size
    assert draft.config.feature_layers == (0, 1)
    assert draft.fuse is not None and tuple(draft.fuse.weight.shape) == (hidden, 2 * hidden)
    # a layer the features do not hold is a clear error, not a silent fallback to the final state
    with pytest.raises(FileNotFoundError, match=r"h\.5"):
        train(
            tiny_run(features, tmp_path / "other", steps=1, feature_layers=(5,)),
            tiny_target_dir,
            tmp_path / "cache",
            log=lambda _: None,
        )


@pytest.mark.parametrize("overrides", [{"feature_noise": -0.1}, {"feature_noise": 0.1, "kind": "glide"}])
def test_feature_noise_is_refused_where_it_means_nothing(features, tmp_path, overrides) -> None:
    from specserve.errors import InvalidArgument
    from specserve.training.distill import DistillSettings

    settings = {"features": features / "features", "out_dir": tmp_path, "kind": "eagle", **overrides}
    with pytest.raises(InvalidArgument, match="feature_noise"):
        DistillSettings(**settings)  # type: ignore[arg-type]
