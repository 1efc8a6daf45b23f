"""Drafters built from the axes (specserve/methods.py) on tiny random models: every catalog name builds the
drafter it always did (class, shape, stop policy, its costs, suffix candidates in front), and every
combination of the axes without a name gives the target's own greedy output."""

from __future__ import annotations

import pytest
from valid_axes import VALID_AXES

from specserve.catalog import CATALOG, Method, method_info
from specserve.core.cost import NOMINAL_CPU_COST
from specserve.core.protocols import Drafter
from specserve.core.request import GenerationRequest
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stopping import CostPolicy, DecisionPolicy
from specserve.core.suffix_drafter import SuffixDrafter
from specserve.engine import Engine
from specserve.methods import METHODS, method_spec
from specserve.runtime.drafter import DraftShape, WidthDrafter
from specserve.runtime.mcsd import MultiCandidateDrafter
from specserve.runtime.stopper import shipped_decision_model
from specserve.runtime.target import LocalVerifier
from specserve.settings import EngineSettings

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 96

# What each name built when every name's factory was listed by hand: (drafter, depth or MCSD levels,
# fixed widths or target-seeded roots, CaPE, stop policy). "vanilla" is the engine's vanilla drafter
# (the trained block without cross-attention, else the separate causal LM); a suffix method is the
# SuffixDrafter in front of its model's drafter, or of none.
Facts = tuple[str, object, object, bool, str] | None
BUILT: dict[str, Facts | tuple[str, Facts]] = {
    "target": None,
    "hf": None,
    "hf-pld": None,
    "hf-assisted": None,
    "vanilla": ("vanilla", 4, (), False, "FixedPolicy"),
    "vanilla-tree": ("vanilla", 4, (2, 2), False, "FixedPolicy"),
    "vanilla-cape-svip": ("vanilla", 8, (), True, "SvipPolicy"),
    "vanilla-cape-cost": ("vanilla", 8, (), True, "CostPolicy"),
    "vanilla-cape-suffix": ("suffix", ("vanilla", 8, (), True, "CostPolicy")),
    "vanilla-gated": ("vanilla", 2, (), False, "GatedPolicy"),
    "glide": ("GlideDrafter", 4, (), False, "FixedPolicy"),
    "glide-cape": ("GlideDrafter", 4, (), True, "FixedPolicy"),
    "glide-cape-1": ("GlideDrafter", 1, (), True, "FixedPolicy"),
    "glide-cape-2": ("GlideDrafter", 2, (), True, "FixedPolicy"),
    "glide-cape-svip": ("GlideDrafter", 8, (), True, "SvipPolicy"),
    "glide-cape-adaedl": ("GlideDrafter", 8, (), True, "AdaEdlPolicy"),
    "glide-cape-decision": ("GlideDrafter", 8, (), True, "DecisionPolicy"),
    "glide-cape-cost": ("GlideDrafter", 8, (), True, "CostPolicy"),
    "mcsd": ("MultiCandidateDrafter", (2, 2, 1), False, False, "FixedPolicy"),
    "mcsd-target-init": ("MultiCandidateDrafter", (2, 2, 1, 1), True, False, "FixedPolicy"),
    "suffix": ("suffix", None),
    "glide-cape-suffix": ("suffix", ("GlideDrafter", 8, (), True, "CostPolicy")),
    "eagle": ("EagleDrafter", 4, (), False, "FixedPolicy"),
    "eagle-cape": ("EagleDrafter", 4, (), True, "FixedPolicy"),
    "eagle-cape-cost": ("EagleDrafter", 8, (), True, "CostPolicy"),
    "eagle-cape-suffix": ("suffix", ("EagleDrafter", 8, (), True, "CostPolicy")),
}


@pytest.fixture(scope="module")
def engine(tiny_target_dir, tmp_path_factory) -> Engine:
    calibration = tmp_path_factory.mktemp("calibration") / "costs.json"
    settings = EngineSettings.from_env(
        model_dir=tiny_target_dir, draft_layers=1, calibration_path=calibration
    )
    return Engine(settings)


def facts(drafter: Drafter | None, vanilla: type) -> Facts | tuple[str, Facts]:
    if drafter is None:
        return None
    if isinstance(drafter, SuffixDrafter):
        return "suffix", facts(drafter.inner, vanilla)  # type: ignore[return-value]
    policy = type(drafter.stop_policy).__name__  # type: ignore[attr-defined]
    if isinstance(drafter, MultiCandidateDrafter):
        return type(drafter).__name__, drafter.shape.k_config, drafter.shape.target_roots, False, policy
    assert isinstance(drafter, WidthDrafter)
    name = "vanilla" if type(drafter) is vanilla else type(drafter).__name__
    return name, drafter.shape.depth, drafter.shape.widths, drafter.cape is not None, policy


def built(engine: Engine, method: str, sampling: SamplingParams = GREEDY) -> Drafter | None:
    verifier = LocalVerifier(engine.target_runner, CAPACITY, sampling=sampling)
    return method_spec(method).make_drafter(engine, CAPACITY, verifier.cache, sampling)


def model_of(drafter: Drafter | None) -> Drafter | None:
    return drafter.inner if isinstance(drafter, SuffixDrafter) else drafter


def test_every_name_builds_the_drafter_it_always_did(engine):
    verifier = LocalVerifier(engine.target_runner, CAPACITY)
    vanilla = type(engine.vanilla_drafter(verifier.cache, CAPACITY, DraftShape()))
    assert list(BUILT) == list(CATALOG)
    for method in CATALOG:
        drafter = built(engine, method)
        assert facts(drafter, vanilla) == BUILT[method], method
        assert METHODS[method].make_drafter is not None and METHODS[method].info is CATALOG[method]


@pytest.mark.parametrize("method", [m for m in Method if method_info(m).axes is not None], ids=str)
def test_a_name_and_its_axes_build_the_same_drafter(engine, method):
    axes = method_info(method).axes
    assert axes is not None
    vanilla = type(engine.vanilla_drafter(LocalVerifier(engine.target_runner, 8).cache, 8, DraftShape()))
    assert facts(built(engine, axes.spelling), vanilla) == facts(built(engine, method), vanilla)


def test_each_policy_reads_the_costs_and_stopper_of_its_own_draft(engine):
    for method, draft in (
        ("vanilla-cape-cost", "vanilla"),
        ("eagle-cape-suffix", "eagle"),
        ("glide+top2+cost", "glide"),
    ):
        policy = model_of(built(engine, method)).stop_policy  # type: ignore[union-attr]
        assert isinstance(policy, CostPolicy), method
        assert policy.cost == engine.cost_model_for(draft), method
        assert policy.batch_aware and policy.model is shipped_decision_model(draft)
    decision = model_of(built(engine, "eagle+chain+decision")).stop_policy  # type: ignore[union-attr]
    assert isinstance(decision, DecisionPolicy) and decision.model is shipped_decision_model("eagle")


def test_suffix_candidates_are_sized_by_this_machine_and_by_the_batch_only_when_greedy(engine):
    greedy = built(engine, "eagle-cape-suffix")
    assert isinstance(greedy, SuffixDrafter)
    assert greedy.cost == engine.cost_model_for("eagle") and greedy.batch_aware
    sampled = built(engine, "suffix", SamplingParams(temperature=0.7))
    assert isinstance(sampled, SuffixDrafter) and sampled.inner is None
    assert sampled.cost == engine.cost_model_for(None) and sampled.cost != NOMINAL_CPU_COST
    assert not sampled.batch_aware


def test_a_sampled_cost_policy_is_sized_as_if_alone_whatever_the_tree(engine):
    """Seeded sampling stays reproducible under load: MCSD trees too, not only spine trees."""
    for method in ("vanilla+mcsd+cost", "glide+cape+cost"):
        assert not model_of(built(engine, method, SamplingParams(temperature=0.7))).stop_policy.batch_aware  # type: ignore[union-attr]
        assert model_of(built(engine, method)).stop_policy.batch_aware  # type: ignore[union-attr]


UNNAMED = [axes for axes in VALID_AXES if method_info(axes.spelling).name not in CATALOG]


def test_the_names_are_a_few_of_the_combinations():
    named = {method_info(axes.spelling).name for axes in VALID_AXES} - {a.spelling for a in UNNAMED}
    assert named == {m for m, info in CATALOG.items() if info.axes is not None} - {
        "glide-cape-1",
        "glide-cape-2",
        "vanilla-gated",  # a chain of 2, not the chain's own depth
    }
    assert len(UNNAMED) == len(VALID_AXES) - len(named) == 103


def greedy(engine: Engine, method: str) -> list[int]:
    request = GenerationRequest.build(method=method, max_new_tokens=12, ignore_eos=True)
    return engine.generate_ids(PROMPT, request).token_ids


@pytest.fixture(scope="module")
def target_output(engine) -> list[int]:
    return greedy(engine, "target")


@pytest.mark.parametrize("axes", UNNAMED, ids=lambda axes: axes.spelling)
def test_every_unnamed_combination_gives_the_targets_output(engine, target_output, axes):
    assert greedy(engine, axes.spelling) == target_output
