"""Self-distillation data and loss: reproducible sharded generation that resumes mid-shard, the KD
loss by hand, and a prompt set that never contains an MT-Bench question."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.models import load_tokenizer
from specserve.training.features import IGNORE
from specserve.training.generation import (
    ANSWERS,
    INSTRUCT,
    PROMPTS_FILE,
    GenerationSettings,
    generation_dtype,
    load_prompts,
    read_stage,
    run_stage,
)
from specserve.training.kd import kd_loss
from specserve.training.prompt_set import (
    Prompt,
    base_prompts,
    contains_mtbench,
    finalise,
    mtbench_turns,
    user,
)

REPO = Path(__file__).resolve().parents[3]
SHIPPED_DATA = REPO / "data" / "self-distill"
SHIPPED_SETS = [SHIPPED_DATA, REPO / "data" / "self-distill-seed1"]  # every shipped set of answers
PROMPTS = [Prompt("test", user(f"Tell me about topic number {i}.")) for i in range(7)]
# 2 shards of 4 prompts, 2 batches each: greedy, T 0.7, greedy, T 0.85; all must reproduce.
SETTINGS = GenerationSettings(
    shard_size=4, batch_size=2, max_new_tokens=6, dtype="float32", static_cache=False
)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), load_tokenizer(tiny_target_dir)


def _generate(tiny, stage: Path, **kwargs) -> None:
    model, tokenizer = tiny
    run_stage(model, tokenizer, stage, lambda: list(PROMPTS), SETTINGS, log=lambda _: None, **kwargs)


def _same(a, b) -> None:
    for name, value in asdict(a).items():
        np.testing.assert_array_equal(value, getattr(b, name), err_msg=name)


def test_generation_reproduces_a_fixed_seed_and_resumes_a_half_done_shard(tiny, tmp_path) -> None:
    _generate(tiny, tmp_path / "a")
    whole = read_stage(tmp_path / "a")
    assert len(whole) == len(PROMPTS) and sorted({round(t, 2) for t in whole.temperature.tolist()}) == [
        0.0,
        0.7,
        0.85,
    ]
    assert whole.prompt_ids.dtype == np.uint16 and whole.answer_ids.dtype == np.uint16
    assert whole.prompt_index.tolist() == list(range(len(PROMPTS)))

    _generate(tiny, tmp_path / "b", stop_after_batches=1)  # killed after the first batch of shard 0
    assert [p.name for p in sorted((tmp_path / "b").iterdir())] == [PROMPTS_FILE, "shard-00000.part"]
    assert len(list((tmp_path / "b" / "shard-00000.part").glob("batch-*.npz"))) == 1
    _generate(tiny, tmp_path / "b")  # resumes at batch 1 of shard 0
    assert sorted(p.name for p in (tmp_path / "b").glob("shard-*")) == ["shard-00000.npz", "shard-00001.npz"]
    _same(read_stage(tmp_path / "b"), whole)


def test_auto_generation_dtype_is_bf16_only_where_a_fast_bf16_kernel_runs(monkeypatch) -> None:
    assert generation_dtype("float16", "cpu") == "float16"  # an explicit choice is kept
    assert generation_dtype("auto", "cuda") == "bfloat16"
    # an AVX2-only CPU (torch's oneDNN reports no bf16 path): fp32 on packed weights
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert generation_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert generation_dtype("auto", "cpu") == "bfloat16"


def test_kd_loss_equals_a_hand_computation() -> None:
    scores = torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.5, 0.5, 0.0, 0.0]])
    topk_index = torch.tensor([[3, 0, -1], [1, 2, 0]])  # -1: a top-k token outside the draft's head
    topk_probs = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.25, 0.25]])
    labels = torch.tensor([3, IGNORE])
    loss, kl, ce = kd_loss(scores, topk_index, topk_probs, labels, kd_weight=0.5, ce_weight=2.0)

    def log_softmax(row: list[float]) -> list[float]:
        norm = math.log(sum(math.exp(x) for x in row))
        return [x - norm for x in row]

    q0, q1 = log_softmax([1.0, 0.0, -1.0, 2.0]), log_softmax([0.5, 0.5, 0.0, 0.0])
    p0 = [0.6 / 0.8, 0.2 / 0.8]  # renormalised over the tokens the head scores (ids 3, 0)
    kl0 = p0[0] * (math.log(p0[0]) - q0[3]) + p0[1] * (math.log(p0[1]) - q0[0])
    kl1 = 0.5 * (math.log(0.5) - q1[1]) + 0.25 * (math.log(0.25) - q1[2]) + 0.25 * (math.log(0.25) - q1[0])
    expected_kl = (kl0 + kl1) / 2
    expected_ce = -q0[3]  # row 1 has no label
    assert float(kl) == pytest.approx(expected_kl, rel=1e-5)
    assert float(ce) == pytest.approx(expected_ce, rel=1e-5)
    assert float(loss) == pytest.approx(0.5 * expected_kl + 2.0 * expected_ce, rel=1e-5)


def test_the_prompt_set_holds_no_mtbench_question() -> None:
    turns = mtbench_turns()
    assert len(turns) == 160
    # The detector can fail: a prompt quoting an MT-Bench question, reworded in case and spacing.

    from specserve.bench.workloads import default_prompts_path

    first = json.loads(default_prompts_path().read_text().splitlines()[0])["turns"][0]
    assert contains_mtbench(Prompt("x", user("Please answer: " + first.upper())), turns)
    # The frozen prompt sets the shipped answers were generated from, else the set built now.
    frozen = [data / stage / PROMPTS_FILE for data in SHIPPED_SETS for stage in (INSTRUCT, ANSWERS)]
    prompts = [p for path in frozen if path.is_file() for p in load_prompts(path)]
    if not frozen[1].is_file():
        prompts += finalise(base_prompts(docstrings=300), seed=0)
    assert len(prompts) > 1000
    assert all(path.is_file() for path in frozen[2:])  # the second set ships its prompts
    leaked = [p for p in prompts if contains_mtbench(p, turns)]
    assert not leaked, leaked[:3]
