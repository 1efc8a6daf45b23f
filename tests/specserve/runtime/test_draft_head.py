"""A separate draft's LM head cut to part of the vocabulary: the kept rows score as before, the rest
never, and the output stays the target's."""

from __future__ import annotations

import pytest
import torch

from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.runtime.draft_head import ReducedHead, kept_token_ids
from specserve.settings import EngineSettings


def test_the_kept_ids_are_the_first_rows_and_the_special_tokens_within_the_vocabulary():
    assert kept_token_ids(10, 3, [9, 2, 42, -1]).tolist() == [0, 1, 2, 9]
    assert kept_token_ids(4, 100, []).tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidArgument):
        kept_token_ids(10, 0, [])


@pytest.mark.parametrize("kernel", ["native", "auto"])
def test_kept_rows_score_as_the_full_head_and_the_others_never(kernel):
    torch.manual_seed(0)
    weight = torch.randn(50, 8)  # [V, H]
    hidden = torch.randn(3, 8)  # [n, H]
    keep = kept_token_ids(50, 20, [49])
    logits = ReducedHead(weight, keep, kernel)(hidden)  # [n, V]
    full = hidden @ weight.T  # [n, V]
    assert logits.shape == (3, 50)
    torch.testing.assert_close(logits[:, keep], full[:, keep], rtol=1e-4, atol=1e-4)
    outside = torch.ones(50, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(logits[:, outside]).all()


def test_a_head_on_its_files_codes_stays_on_them_when_cut():
    from gguf import GGMLQuantizationType, quants

    from specserve.models.gguf_quant import decode
    from specserve.runtime.int4 import Int4Linear, Int4Weight

    torch.manual_seed(0)
    dense = torch.randn(64, 32) * 0.1  # [V, H]
    codes = decode("Q8_0", quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0), 64, 32)
    head = Int4Linear(Int4Weight(codes), None)
    keep = kept_token_ids(64, 20, [63])
    cut = ReducedHead(head, keep)
    assert isinstance(cut.rows, Int4Linear) and cut.rows.out_features == len(keep)
    hidden = torch.randn(3, 32)
    logits = cut(hidden)  # [n, V]
    assert torch.equal(logits[:, keep], head(hidden)[:, keep])  # the same codes, the same kernel rows
    assert torch.isneginf(logits[:, 20:63]).all()


def test_a_cut_draft_head_proposes_only_kept_ids_and_keeps_the_output(tiny_target_dir, tmp_path):
    """The target itself as the separate draft: with its whole head every drafted token is accepted, so
    any difference in the output or any token proposed outside the kept ids would show."""
    prompt = list(range(1000, 1016))
    request = GenerationRequest.build(method="vanilla", max_new_tokens=24, ignore_eos=True)
    settings = dict(
        model_dir=tiny_target_dir, draft_dir=tiny_target_dir, calibration_path=tmp_path / "c.json"
    )
    whole = Engine(EngineSettings.from_env(**settings, draft_head_rows=0))
    expected = whole.generate_ids(
        prompt, GenerationRequest.build(method="target", max_new_tokens=24, ignore_eos=True)
    )
    cut = Engine(EngineSettings.from_env(**settings, draft_head_rows=2048))
    head = cut.vanilla_draft_runner.model.lm_head
    assert isinstance(head, ReducedHead) and not isinstance(
        whole.vanilla_draft_runner.model.lm_head, ReducedHead
    )
    assert set(cut.tokenizer.all_special_ids) <= set(head.keep.tolist())

    cache = cut.vanilla_draft_runner.new_cache(64)
    logits = cut.vanilla_draft_runner.forward(cache, prompt, last_only=True)  # [V]
    assert int(logits.argmax()) in set(head.keep.tolist())
    assert torch.isneginf(logits[2048 + 100 :]).sum() > 0

    for engine in (whole, cut):
        result = engine.generate_ids(prompt, request)
        assert result.token_ids == expected.token_ids
    assert whole.generate_ids(prompt, request).stats.num_accepted_tokens > 0
