"""The default model on its file's own 4-bit weights (`weights=as-shipped`): every speculative method's
greedy output equals the same quantized target alone, token for token; every projection runs on the
codes; the dense view of each weight is the file's values."""

from __future__ import annotations

import pytest
import torch

from specserve.core.request import GenerationRequest
from specserve.runtime.int4 import Int4Embedding, Int4Linear
from specserve.runtime.kernels import FusedPart
from specserve.settings import EngineSettings

PROMPTS = (
    "Explain what a hash table is.",
    "Rewrite this sentence in the past tense: 'The cat sits on the mat and watches the birds.'",
)
METHODS = ("eagle-cape-suffix", "glide-cape", "vanilla", "suffix")

pytestmark = [pytest.mark.model, pytest.mark.compute_only]


@pytest.fixture(scope="module")
def engine(pinned_costs):
    from specserve.engine import Engine

    # Trees sized from the suite's cost record (tests/pinned_costs.py), not measured here.
    return Engine(EngineSettings.from_env(weights="as-shipped", calibration_path=pinned_costs))


def test_every_projection_and_the_tied_head_run_on_the_files_codes(engine):
    model = engine.target_model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedPart) and isinstance(layer.self_attn.o_proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Int4Linear) and isinstance(model.lm_head, Int4Linear)
    assert isinstance(model.model.embed_tokens, Int4Embedding)
    assert engine.runtime_info()["weights"] == "as-shipped"


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculative_output_equals_the_quantized_target_alone(engine, method):
    for prompt in PROMPTS:
        reference = engine.generate(prompt, GenerationRequest.build(method="target", max_new_tokens=48))
        result = engine.generate(prompt, GenerationRequest.build(method=method, max_new_tokens=48))
        assert result.token_ids == reference.token_ids, (method, prompt)
    assert result.stats.num_target_forwards <= len(result.token_ids)


def test_a_branching_trees_logits_equal_each_path_decoded_alone_bit_for_bit(engine):
    """The int4 kernel's rows do not depend on the batch and attention runs in float64, so a tree
    forward reproduces the one-token forwards exactly (greedy identity does not rest on luck)."""
    runner = engine.target_runner
    prompt = engine.encode_prompt("Explain what a hash table is.")
    tokens, parents = [100, 200, 300, 400, 500, 600], [-1, 0, 0, 1, 2, 3]
    paths = [[100], [100, 200], [100, 300], [100, 200, 400], [100, 300, 500], [100, 200, 400, 600]]
    cache = runner.new_cache(256)
    runner.forward(cache, prompt, last_only=True)
    tree = runner.forward(cache, tokens, parents)  # [6, V]
    for node, path in enumerate(paths):
        alone = runner.new_cache(256)
        runner.forward(alone, prompt, last_only=True)
        for token in path:
            logits = runner.forward(alone, [token])
        assert torch.equal(tree[node], logits[-1]), node
