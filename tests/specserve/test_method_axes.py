"""A method's axes: every combination that can run parses back from its spelling, defaults fill in the
depth, and every combination that cannot run is refused with its reason."""

from __future__ import annotations

import pytest
from valid_axes import VALID_AXES as VALID

from specserve.core.stop_names import StopPolicyName
from specserve.errors import InvalidArgument
from specserve.method_axes import ADAPTIVE_DEPTH, MAX_DEPTH, Draft, MethodAxes, Tree


def test_the_axes_are_independent_where_the_drafters_allow() -> None:
    # none: with or without suffix candidates; every spine draft: 3 trees x 6 policies x suffix or not;
    # the vanilla draft's MCSD trees: 6 policies x suffix, and target-seeded roots alone
    assert len(VALID) == 2 + 3 * 3 * 6 * 2 + 6 * 2 + 1
    assert {a.stop for a in VALID if a.tree is Tree.CAPE and a.draft is Draft.EAGLE} == set(StopPolicyName)


@pytest.mark.parametrize("axes", VALID, ids=lambda a: a.spelling)
def test_every_spelling_reads_back_to_its_axes(axes: MethodAxes) -> None:
    assert MethodAxes.parse(axes.spelling) == axes
    written = f"{axes.draft}+{axes.tree}-{axes.depth}+{axes.stop}" + ("+suffix" if axes.suffix else "")
    if axes.drafts:  # every axis spelled out, the depth too, names the same axes
        assert MethodAxes.parse(written) == axes


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        ("glide", MethodAxes(Draft.GLIDE, Tree.CHAIN, StopPolicyName.FIXED, depth=4)),
        ("glide+cape-2", MethodAxes(Draft.GLIDE, Tree.CAPE, depth=2)),
        (
            "eagle+cape+cost+suffix",
            MethodAxes(Draft.EAGLE, Tree.CAPE, StopPolicyName.COST, True, ADAPTIVE_DEPTH),
        ),
        ("vanilla+top2+svip", MethodAxes(Draft.VANILLA, Tree.TOP2, StopPolicyName.SVIP, depth=8)),
        ("vanilla+mcsd", MethodAxes(Draft.VANILLA, Tree.MCSD, depth=3)),
        ("vanilla+mcsd-target", MethodAxes(Draft.VANILLA, Tree.MCSD_TARGET, depth=4)),
        ("vanilla+mcsd-6+decision", MethodAxes(Draft.VANILLA, Tree.MCSD, StopPolicyName.DECISION, depth=6)),
        ("none+suffix", MethodAxes(Draft.NONE, suffix=True)),
        ("none", MethodAxes()),
    ],
)
def test_omitted_axes_take_their_defaults(spelling: str, expected: MethodAxes) -> None:
    assert MethodAxes.parse(spelling) == expected


def test_the_default_depth_follows_the_tree_and_the_policy() -> None:
    assert MethodAxes(Draft.GLIDE, Tree.CAPE).depth == 4
    assert MethodAxes(Draft.GLIDE, Tree.CAPE, StopPolicyName.SVIP).depth == ADAPTIVE_DEPTH
    assert MethodAxes(Draft.VANILLA, Tree.MCSD).depth == 3
    assert MethodAxes(Draft.VANILLA, Tree.MCSD_TARGET).depth == 4
    assert MethodAxes(Draft.NONE).depth == 0
    # the default is left out of the spelling; another depth is written
    assert MethodAxes(Draft.GLIDE, Tree.CAPE, depth=4).spelling == "glide+cape"
    assert MethodAxes(Draft.GLIDE, Tree.CHAIN, depth=6).spelling == "glide+chain-6"
    assert MethodAxes(Draft.GLIDE, Tree.CAPE, StopPolicyName.COST, depth=4).spelling == "glide+cape-4+cost"
    assert MethodAxes("glide", "cape", "svip") == MethodAxes(Draft.GLIDE, Tree.CAPE, StopPolicyName.SVIP)


@pytest.mark.parametrize(
    ("spelling", "reason"),
    [
        ("glide+mcsd", "mcsd trees are drafted by the vanilla draft only"),
        ("eagle+mcsd-target", "mcsd-target trees are drafted by the vanilla draft only"),
        ("vanilla+mcsd-target+cost", "mcsd-target trees draft their whole depth"),
        ("vanilla+mcsd-target+suffix", "mcsd-target trees take no suffix candidates"),
        ("vanilla+mcsd-target-1", "depth must be in [2, 16] for mcsd-target trees, got 1"),
        (
            f"glide+cape-{MAX_DEPTH + 1}",
            f"depth must be in [1, {MAX_DEPTH}] for cape trees, got {MAX_DEPTH + 1}",
        ),
        ("glide+cape-0", "a depth must be >= 1"),
        ("none+cape", "without a draft model there is no tree, depth or stop policy"),
        ("none+svip", "without a draft model there is no tree, depth or stop policy"),
        ("none+fixed+suffix", "without a draft model there is no tree, depth or stop policy"),
        ("cape+cost", "names no draft first"),
        ("glide+svip+cape", "part 'cape' is out of order"),
        ("glide+cape+suffix+suffix", "part 'suffix' is out of order"),
        ("glide+wide", "part 'wide' is unknown"),
        ("glide+cape-x", "part 'cape-x' is unknown"),
        ("glide+", "part '' is unknown"),
        ("medusa+cape", "has an unknown part 'medusa'"),
    ],
)
def test_axes_that_cannot_run_are_refused_with_the_reason(spelling: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        MethodAxes.parse(spelling)
    assert str(raised.value).startswith(f"method {spelling!r}"), raised.value
    assert reason in str(raised.value), raised.value


def test_axes_made_directly_are_checked_the_same_way() -> None:
    with pytest.raises(InvalidArgument, match="mcsd trees are drafted by the vanilla draft only"):
        MethodAxes(Draft.EAGLE, Tree.MCSD)
    with pytest.raises(InvalidArgument, match="without a draft model"):
        MethodAxes(Draft.NONE, depth=3)
    with pytest.raises(ValueError):
        MethodAxes("medusa")  # type: ignore[arg-type]


def test_the_facts_follow_from_the_axes() -> None:
    lossy = [a for a in VALID if not a.lossless]
    assert [a.spelling for a in lossy] == ["vanilla+mcsd-target"]
    assert {a.spelling for a in VALID if not a.remote} == {"vanilla+mcsd-target"}
    assert all(a.hidden_states == (a.draft is Draft.EAGLE) for a in VALID)
    assert all(a.drafts == (a.draft is not Draft.NONE) for a in VALID)
    suffixed = MethodAxes.parse("eagle+cape+svip+suffix")
    assert suffixed.model() == MethodAxes.parse("eagle+cape+svip") and not suffixed.model().suffix


def test_a_description_names_every_axis() -> None:
    text = MethodAxes.parse("vanilla+top2-3+adaedl+suffix").describe()
    assert text.startswith("separate draft model, chain with top-2 leaves at levels 1-2, depth <= 3")
    assert "AdaEDL" in text and text.endswith("suffix candidates merged in")
    assert (
        MethodAxes.parse("glide+cape-2").describe()
        == "GliDe draft, CaPE tree (top-k leaves by confidence), depth 2"
    )
    assert MethodAxes.parse("none").describe() == "no draft model: the target alone"
