"""The draft methods' names and facts, without their implementations: torch-free, so the router can
validate and list methods.

A method is its axes (specserve/method_axes.py: draft x tree x stop policy x suffix candidates); each name
here is an alias of particular axes, and a request may name axes instead (`eagle+cape+svip`). The
exceptions are transformers' own `generate` runs, references outside the speculative loop.
`specserve.methods` builds each method's drafter from its axes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from specserve.core.stop_names import StopPolicyName
from specserve.errors import InvalidArgument
from specserve.method_axes import (
    ADAPTIVE_DEPTH,
    MAX_DEPTH,
    SYNTAX,
    TREES,
    Draft,
    MethodAxes,
    Tree,
    axes_fault,
)


class Method(StrEnum):
    TARGET = "target"  # the target alone on our engine: the speedup baseline
    HF = "hf"  # transformers `generate`: the reference implementation
    HF_PLD = "hf-pld"  # transformers `generate` with prompt lookup decoding: the training-free peer
    VANILLA = "vanilla"  # a separate small causal LM drafting a chain
    VANILLA_TREE = "vanilla-tree"  # the same draft, top-2 leaves at the first two depths
    VANILLA_CAPE_SVIP = "vanilla-cape-svip"  # the same draft + CaPE, spine length by SVIP's entropy rule
    VANILLA_CAPE_COST = "vanilla-cape-cost"  # the same draft, CaPE trees sized for expected tokens/s
    VANILLA_CAPE_SUFFIX = "vanilla-cape-suffix"  # suffix candidates merged with vanilla-cape-cost's tree
    VANILLA_GATED = "vanilla-gated"  # the same draft, a chain of 1 or 2 (the better) where it pays, else none
    HF_ASSISTED = "hf-assisted"  # transformers `generate` with the vanilla draft as `assistant_model`
    GLIDE = "glide"  # a GliDe draft reading the target's KV cache, chain of 4
    GLIDE_CAPE = "glide-cape"  # the same draft, CaPE: top-k leaves by the draft's confidence
    GLIDE_CAPE_1 = "glide-cape-1"  # ... fixed depth 1 and 2: with glide-cape (4), the fixed-length sweep
    GLIDE_CAPE_2 = "glide-cape-2"  # the adaptive policies are compared with
    GLIDE_CAPE_SVIP = "glide-cape-svip"  # GliDe + CaPE, spine length by SVIP's entropy rule
    GLIDE_CAPE_ADAEDL = "glide-cape-adaedl"  # ... by AdaEDL's entropy bound with an adaptive lambda
    GLIDE_CAPE_DECISION = "glide-cape-decision"  # ... by the learned stopper (train-stopper)
    GLIDE_CAPE_COST = "glide-cape-cost"  # ... and width, by expected tokens per second on this machine
    MCSD = "mcsd"  # a separate draft sampling k_d candidates per node, lossless multi-candidate rule
    MCSD_TARGET_INIT = "mcsd-target-init"  # the target seeds the roots: exact at T = 0, biased at T > 0
    SUFFIX = "suffix"  # candidates from the session's own text (suffix index), no draft model
    GLIDE_CAPE_SUFFIX = "glide-cape-suffix"  # suffix candidates merged with glide-cape-cost's tree
    EAGLE = "eagle"  # a hidden-state draft reading the target's final hidden states, chain of 4
    EAGLE_CAPE = "eagle-cape"  # the same draft, CaPE trees
    EAGLE_CAPE_COST = "eagle-cape-cost"  # ... depth and width by expected tokens per second
    EAGLE_CAPE_SUFFIX = "eagle-cape-suffix"  # suffix candidates merged with eagle-cape-cost's tree


# What `generate`, the router and `specserve stack` use unless told otherwise: the fastest lossless
# method in docs/benchmarks.md: the cost policy's CaPE trees (the fastest policy in all four
# adaptive-drafting runs) from the hidden-state draft (ahead of GliDe's in every side-by-side run since
# the policy's acceptance estimate ages), with the session's suffix candidates merged in, which cost no
# draft forward. It needs this machine's calibration: measured once and cached. `eagle-cape-cost` is the
# same without suffix candidates (a request's opt-out); `glide-cape-suffix` the same with GliDe's draft.
DEFAULT_METHOD = Method.EAGLE_CAPE_SUFFIX.value


# transformers' documented setting for prompt lookup decoding (`prompt_lookup_num_tokens`).
HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class MethodInfo:
    """A method's name, description and axes; every other fact follows from the axes."""

    name: str  # a catalog name, else the axes' spelling
    axes: MethodAxes | None  # None: transformers' own `generate`, outside the speculative loop
    description: str

    @property
    def axes_spelling(self) -> str | None:
        """Its axes spelled out, which a request may name instead (None: transformers' own runs)."""
        return self.axes.spelling if self.axes is not None else None

    @property
    def uses_hf_generate(self) -> bool:
        """In-process only: bypasses the speculative loop."""
        return self.axes is None

    @property
    def lossless(self) -> bool:
        """False: exact at T = 0 only; the request must set allow_lossy at T > 0."""
        return self.axes is None or self.axes.lossless

    @property
    def drafts(self) -> bool:
        """A draft model takes part (False: the target alone, or suffix candidates alone)."""
        return self.axes is not None and self.axes.drafts

    @property
    def remote(self) -> bool:
        """Served by the distributed stack (transformers' runs and target-seeded roots are not)."""
        return self.axes is not None and self.axes.remote

    @property
    def suffix(self) -> bool:
        """Suffix candidates (core/suffix_drafter.py) are merged into the rounds: with a draft model, into
        its trees (the draft service runs `model_method`), else they are the only drafts."""
        return self.axes is not None and self.axes.suffix

    @property
    def hidden_states(self) -> bool:
        """The draft reads the target's final hidden states (specserve/eagle): the target keeps them for
        the session and its KV feed carries them."""
        return self.axes is not None and self.axes.hidden_states

    @property
    def model_method(self) -> str:
        """The method without suffix candidates: what the draft service runs behind the router's."""
        return method_name(self.axes.model()) if self.axes is not None else self.name


def _alias(method: Method, axes: str | None, description: str) -> MethodInfo:
    return MethodInfo(method.value, MethodAxes.parse(axes) if axes is not None else None, description)


CATALOG: dict[Method, MethodInfo] = {
    Method(info.name): info
    for info in (
        _alias(Method.TARGET, "none", "target alone, plain decoding on the specserve engine"),
        _alias(Method.HF, None, "transformers generate (reference)"),
        _alias(
            Method.HF_PLD,
            None,
            f"transformers generate, prompt lookup of {HF_PROMPT_LOOKUP_TOKENS} tokens (the peer of suffix)",
        ),
        _alias(
            Method.HF_ASSISTED,
            None,
            "transformers generate, the vanilla draft model as assistant_model (the peer of vanilla)",
        ),
        _alias(Method.VANILLA, "vanilla", "separate draft model, chain of 4"),
        _alias(
            Method.VANILLA_TREE,
            "vanilla+top2",
            "separate draft model, chain of 4 with top-2 leaves at depths 1-2",
        ),
        _alias(
            Method.VANILLA_CAPE_SVIP,
            "vanilla+cape+svip",
            f"separate draft model + CaPE, depth <= {ADAPTIVE_DEPTH} by SVIP's entropy rule",
        ),
        _alias(
            Method.VANILLA_CAPE_COST,
            "vanilla+cape+cost",
            f"separate draft model + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s",
        ),
        _alias(
            Method.VANILLA_CAPE_SUFFIX,
            "vanilla+cape+cost+suffix",
            "suffix candidates merged with vanilla-cape-cost's tree; suffix-only rounds skip the draft",
        ),
        _alias(
            Method.VANILLA_GATED,
            "vanilla+chain-2+gated",
            "separate draft model, a chain of 1 or 2 (the better) where it pays in expected tok/s, else none",
        ),
        _alias(Method.GLIDE, "glide", "GliDe draft glimpsing the target's KV cache, chain of 4"),
        _alias(
            Method.GLIDE_CAPE,
            "glide+cape",
            "GliDe draft, depth 4, CaPE top-k leaves by confidence (<= max_tree_nodes nodes)",
        ),
        _alias(Method.GLIDE_CAPE_1, "glide+cape-1", "GliDe draft, depth 1, CaPE top-k leaves by confidence"),
        _alias(Method.GLIDE_CAPE_2, "glide+cape-2", "GliDe draft, depth 2, CaPE top-k leaves by confidence"),
        _alias(
            Method.GLIDE_CAPE_SVIP,
            "glide+cape+svip",
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by SVIP (entropy > 0.6 nats)",
        ),
        _alias(
            Method.GLIDE_CAPE_ADAEDL,
            "glide+cape+adaedl",
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by AdaEDL (adaptive entropy bound)",
        ),
        _alias(
            Method.GLIDE_CAPE_DECISION,
            "glide+cape+decision",
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by the learned stopper (P(accept) <= 0.4)",
        ),
        _alias(
            Method.GLIDE_CAPE_COST,
            "glide+cape+cost",
            f"GliDe + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s (calibrated)",
        ),
        _alias(
            Method.MCSD,
            "vanilla+mcsd",
            "separate draft, MCSD tree (2, 2, 1) of sampled candidates, lossless multi-candidate rule",
        ),
        _alias(
            Method.MCSD_TARGET_INIT,
            "vanilla+mcsd-target",
            "target seeds 2 roots, draft tree (2, 1, 1) under each; exact greedy, BIASED at T > 0",
        ),
        _alias(
            Method.SUFFIX,
            "none+suffix",
            "no draft model: continuations of the session's own earlier text (suffix index), sized by cost",
        ),
        _alias(
            Method.GLIDE_CAPE_SUFFIX,
            "glide+cape+cost+suffix",
            "suffix candidates merged with glide-cape-cost's tree; suffix-only rounds skip the draft",
        ),
        _alias(
            Method.EAGLE,
            "eagle",
            "hidden-state draft reading the target's final hidden states, chain of 4",
        ),
        _alias(
            Method.EAGLE_CAPE,
            "eagle+cape",
            "hidden-state draft, depth 4, CaPE top-k leaves by confidence (<= max_tree_nodes nodes)",
        ),
        _alias(
            Method.EAGLE_CAPE_COST,
            "eagle+cape+cost",
            f"hidden-state draft + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s",
        ),
        _alias(
            Method.EAGLE_CAPE_SUFFIX,
            "eagle+cape+cost+suffix",
            "suffix candidates merged with eagle-cape-cost's tree; suffix-only rounds skip the draft",
        ),
    )
}

# Axes -> the catalog name that is their alias (each name has axes of its own).
_ALIASES: dict[MethodAxes, MethodInfo] = {i.axes: i for i in CATALOG.values() if i.axes is not None}


def method_info(name: str, known: Iterable[str] | None = None) -> MethodInfo:
    """The method `name` names: a catalog name, or axes (`glide+cape+svip`), whose info is their alias's
    when they have one. InvalidArgument otherwise, listing `known` (default: every catalog name)."""
    if name in CATALOG:
        return CATALOG[Method(name)]
    if "+" not in name and name not in set(Draft):
        listed = ", ".join(known if known is not None else CATALOG)
        raise InvalidArgument(f"unknown method {name!r}; known methods: {listed}; or name its axes, {SYNTAX}")
    axes = MethodAxes.parse(name)
    return _ALIASES.get(axes) or MethodInfo(axes.spelling, axes, axes.describe())


def method_name(axes: MethodAxes) -> str:
    """What a method of these axes is called: its catalog name, else the axes' spelling."""
    alias = _ALIASES.get(axes)
    return alias.name if alias is not None else axes.spelling


@dataclass(frozen=True)
class MethodSupport:
    """Which methods a deployment runs: the in-process engine all of them; the router those the
    distributed stack serves (`remote`), and those with a draft model only beside a draft service."""

    in_process: bool = True
    draft_models: bool = True

    def runs(self, info: MethodInfo) -> bool:
        return (self.in_process or info.remote) and (self.draft_models or not info.drafts)

    def names(self) -> list[str]:
        """The catalog names it runs, in catalog order."""
        return [str(method) for method, info in CATALOG.items() if self.runs(info)]

    def axes_pattern(self) -> str:
        """A regular expression (JSON Schema's `pattern`) of exactly the axes spellings it may run: every
        combination `MethodAxes` accepts, each tree's depths in its range, so that a request the schema
        allows is one the API runs."""
        drafts = [d for d in Draft if d is not Draft.NONE] if self.draft_models else []
        trees = [t for t in Tree if self.in_process or TREES[t].remote]
        models = [
            _spelling_pattern(draft, tree, stop, suffix)
            for draft in drafts
            for tree in (None, *trees)
            for stop in (None, *StopPolicyName)
            for suffix in (False, True)
            if axes_fault(draft, tree or Tree.CHAIN, stop or StopPolicyName.FIXED, suffix, 0) is None
        ]
        return f"^(?:none(?:\\+suffix)?{''.join('|' + m for m in models)})$"


def _spelling_pattern(draft: Draft, tree: Tree | None, stop: StopPolicyName | None, suffix: bool) -> str:
    """DRAFT[+TREE[-DEPTH]][+STOP][+suffix] for one combination; DEPTH in the tree's range."""
    parts = [str(draft)]
    if tree is not None:
        depths = "|".join(str(d) for d in range(TREES[tree].min_depth, MAX_DEPTH + 1))
        parts.append(f"\\+{tree}(?:-0*(?:{depths}))?")
    if stop is not None:
        parts.append(f"\\+{stop}")
    if suffix:
        parts.append("\\+suffix")
    return "".join(parts)


IN_PROCESS = MethodSupport()
