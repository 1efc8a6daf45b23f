"""The catalog: every name is an alias of its own axes with the facts it always had, a method named by
its axes is the alias's, and what a deployment runs (its schema's pattern too) follows from the axes."""

from __future__ import annotations

import re

import pytest
from valid_axes import VALID_AXES

from specserve.catalog import (
    CATALOG,
    DEFAULT_METHOD,
    IN_PROCESS,
    Method,
    MethodSupport,
    method_info,
    method_name,
)
from specserve.errors import InvalidArgument

# name -> (axes, lossless, remote, drafts, suffix, hidden states, what the draft service runs): the facts
# each name had when every one was listed by hand.
NAMES = {
    "target": ("none", True, True, False, False, False, None),
    "hf": (None, True, False, False, False, False, None),
    "hf-pld": (None, True, False, False, False, False, None),
    "hf-assisted": (None, True, False, False, False, False, None),
    "vanilla": ("vanilla", True, True, True, False, False, "vanilla"),
    "vanilla-tree": ("vanilla+top2", True, True, True, False, False, "vanilla-tree"),
    "vanilla-cape-svip": ("vanilla+cape+svip", True, True, True, False, False, "vanilla-cape-svip"),
    "vanilla-cape-cost": ("vanilla+cape+cost", True, True, True, False, False, "vanilla-cape-cost"),
    "vanilla-cape-suffix": ("vanilla+cape+cost+suffix", True, True, True, True, False, "vanilla-cape-cost"),
    "vanilla-gated": ("vanilla+chain-2+gated", True, True, True, False, False, "vanilla-gated"),
    "glide": ("glide", True, True, True, False, False, "glide"),
    "glide-cape": ("glide+cape", True, True, True, False, False, "glide-cape"),
    "glide-cape-1": ("glide+cape-1", True, True, True, False, False, "glide-cape-1"),
    "glide-cape-2": ("glide+cape-2", True, True, True, False, False, "glide-cape-2"),
    "glide-cape-svip": ("glide+cape+svip", True, True, True, False, False, "glide-cape-svip"),
    "glide-cape-adaedl": ("glide+cape+adaedl", True, True, True, False, False, "glide-cape-adaedl"),
    "glide-cape-decision": ("glide+cape+decision", True, True, True, False, False, "glide-cape-decision"),
    "glide-cape-cost": ("glide+cape+cost", True, True, True, False, False, "glide-cape-cost"),
    "mcsd": ("vanilla+mcsd", True, True, True, False, False, "mcsd"),
    "mcsd-target-init": ("vanilla+mcsd-target", False, False, True, False, False, "mcsd-target-init"),
    "suffix": ("none+suffix", True, True, False, True, False, None),
    "glide-cape-suffix": ("glide+cape+cost+suffix", True, True, True, True, False, "glide-cape-cost"),
    "eagle": ("eagle", True, True, True, False, True, "eagle"),
    "eagle-cape": ("eagle+cape", True, True, True, False, True, "eagle-cape"),
    "eagle-cape-cost": ("eagle+cape+cost", True, True, True, False, True, "eagle-cape-cost"),
    "eagle-cape-suffix": ("eagle+cape+cost+suffix", True, True, True, True, True, "eagle-cape-cost"),
}


def test_every_name_is_listed_with_the_facts_it_had() -> None:
    assert list(NAMES) == list(CATALOG) and set(NAMES) == {m.value for m in Method}
    for name, (axes, lossless, remote, drafts, suffix, hidden, model) in NAMES.items():
        info = CATALOG[Method(name)]
        assert info.name == name and info.axes_spelling == axes, name
        assert (info.lossless, info.remote, info.drafts, info.suffix) == (lossless, remote, drafts, suffix), (
            name
        )
        assert info.hidden_states == hidden and info.uses_hf_generate == (axes is None), name
        if drafts:
            assert info.model_method == model, name
    assert CATALOG[Method(DEFAULT_METHOD)].axes_spelling == "eagle+cape+cost+suffix"


@pytest.mark.parametrize("method", [m for m in Method if CATALOG[m].axes is not None], ids=str)
def test_a_name_and_its_axes_are_the_same_method(method: Method) -> None:
    info = CATALOG[method]
    assert info.axes is not None
    assert method_info(info.axes.spelling) is info
    assert method_name(info.axes) == method
    assert method_info(method) is info


def test_axes_without_a_name_are_described_from_the_axes() -> None:
    info = method_info("eagle+cape+svip+suffix")
    assert info.name == "eagle+cape+svip+suffix" and info.suffix and info.hidden_states
    assert info.description.startswith("hidden-state draft, CaPE tree") and "SVIP" in info.description
    assert info.model_method == "eagle+cape+svip"  # the draft service runs it without suffix candidates
    assert method_info("glide+cape-8+svip+suffix").model_method == "glide-cape-svip"  # a name where one fits
    assert method_info("glide+cape-6+svip").name == "glide+cape-6+svip"


def test_an_unknown_name_lists_the_known_ones_and_the_axes() -> None:
    with pytest.raises(InvalidArgument) as raised:
        method_info("nope", known=["target", "glide"])
    assert str(raised.value).startswith(
        "unknown method 'nope'; known methods: target, glide; or name its axes"
    )
    with pytest.raises(InvalidArgument, match="eagle-cape-suffix"):
        method_info("nope")  # every name by default
    with pytest.raises(InvalidArgument, match="mcsd trees are drafted by the vanilla draft only"):
        method_info("eagle+mcsd")


SUPPORTS = [
    MethodSupport(),
    MethodSupport(in_process=False),
    MethodSupport(in_process=False, draft_models=False),
    MethodSupport(draft_models=False),
]


def test_what_a_deployment_runs() -> None:
    assert IN_PROCESS.names() == list(CATALOG)
    router = MethodSupport(in_process=False)
    assert set(CATALOG) - set(router.names()) == {"hf", "hf-pld", "hf-assisted", "mcsd-target-init"}
    assert MethodSupport(in_process=False, draft_models=False).names() == ["target", "suffix"]
    assert router.runs(method_info("eagle+top2+adaedl")) and not router.runs(
        method_info("vanilla+mcsd-target-3")
    )


@pytest.mark.parametrize("support", SUPPORTS, ids=str)
def test_the_schema_pattern_admits_exactly_the_axes_a_deployment_runs(support: MethodSupport) -> None:
    pattern = re.compile(support.axes_pattern())
    for axes in VALID_AXES:
        info = method_info(axes.spelling)
        assert bool(pattern.match(axes.spelling)) == support.runs(info), (support, axes.spelling)
    assert not pattern.match("no-such-method") and not pattern.match("glide+cape+suffix+svip")


def test_the_schemas_pattern_allows_exactly_the_spellings_that_run() -> None:
    """What the HTTP schema lets through is what the API accepts: no schema-valid method is refused."""
    import itertools
    import re

    from specserve.catalog import IN_PROCESS
    from specserve.core.stop_names import StopPolicyName
    from specserve.errors import InvalidArgument
    from specserve.method_axes import Draft, MethodAxes, Tree

    pattern = re.compile(IN_PROCESS.axes_pattern())
    trees = [None] + [f"{tree}{depth}" for tree in Tree for depth in ("", *(f"-{d}" for d in range(0, 19)))]
    for draft, tree, stop, suffix in itertools.product(Draft, trees, [None, *StopPolicyName], (False, True)):
        text = "+".join(
            part for part in (str(draft), tree, stop and str(stop), "suffix" if suffix else None) if part
        )
        try:
            MethodAxes.parse(text)
            runs = True
        except InvalidArgument:
            runs = False
        assert bool(pattern.match(text)) == runs, text
