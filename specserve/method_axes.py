"""A draft method as four independent settings, its axes; torch-free, so the router validates them too.

- draft: the model that proposes tokens (`Draft`): none, vanilla, glide or eagle;
- tree: the shape of a round's proposal (`Tree`), with `depth`, the most levels a round drafts;
- stop: the stop policy (core/stop_names.py) deciding, round by round, how much of the depth is drafted;
- suffix: whether candidates from the session's own text (core/suffix_drafter.py) are merged in.

A method is named by its axes as DRAFT[+TREE[-DEPTH]][+STOP][+suffix], in that order: e.g.
`eagle+cape+cost+suffix`, `glide+cape-2`, `vanilla+mcsd`, `none+suffix`. An omitted tree is a chain, an
omitted stop policy `fixed`, an omitted depth the tree's own: its fixed depth under `fixed`, else
ADAPTIVE_DEPTH. `MethodAxes.parse` reads a spelling, `spelling` writes the shortest one; the catalog's
names (specserve/catalog.py) are aliases of particular axes, and specserve/methods.py builds each
method's drafter from its axes alone. Which combinations can run is decided in one place, `axes_fault`
(every MethodAxes is checked when it is made).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from specserve.core.stop_names import StopPolicyName
from specserve.errors import InvalidArgument

# GliDe was trained for a target cache up to 5 tokens stale; adaptive policies may draft up to 8 when sure.
ADAPTIVE_DEPTH = 8
MAX_DEPTH = 16  # the cost policy's own cap: no policy here drafts a longer spine

E = TypeVar("E", bound=StrEnum)


class Draft(StrEnum):
    NONE = "none"  # no draft model: the target alone, or suffix candidates alone
    VANILLA = "vanilla"  # a separate small draft that reads nothing of the target's state
    GLIDE = "glide"  # GliDe: cross-attends to the target's KV cache
    EAGLE = "eagle"  # a hidden-state draft: reads the target's final hidden states


class Tree(StrEnum):
    CHAIN = "chain"  # one token per level
    TOP2 = "top2"  # a chain with the draft's second choice beside it, as a leaf, at levels 1 and 2
    CAPE = "cape"  # CaPE: top-k leaves beside each spine token, k by the draft's confidence
    MCSD = "mcsd"  # MCSD: 2 sampled candidates per node at levels 1 and 2, 1 below
    MCSD_TARGET = "mcsd-target"  # the same, its level 1 the target's top 2 (target-initialised)


_SPINE_DRAFTS = frozenset({Draft.VANILLA, Draft.GLIDE, Draft.EAGLE})


@dataclass(frozen=True)
class TreeFacts:
    words: str  # what a generated description calls it
    drafts: frozenset[Draft]  # the drafts that can draft it
    fixed_depth: int  # its depth under the fixed policy when none is named
    min_depth: int = 1
    adaptive: bool = True  # an adaptive stop policy may end its rounds sooner
    suffix: bool = True  # suffix candidates can be merged into it
    lossless: bool = True  # False: exact at T = 0 only (the engine asks for allow_lossy at T > 0)
    # Served by the distributed stack. Target-initialised roots need the target's top-W sent back with
    # each verification, which the v1 protocol does not carry yet: in-process only.
    remote: bool = True


TREES: dict[Tree, TreeFacts] = {
    Tree.CHAIN: TreeFacts("chain", _SPINE_DRAFTS, fixed_depth=4),
    Tree.TOP2: TreeFacts("chain with top-2 leaves at levels 1-2", _SPINE_DRAFTS, fixed_depth=4),
    Tree.CAPE: TreeFacts("CaPE tree (top-k leaves by confidence)", _SPINE_DRAFTS, fixed_depth=4),
    # Trees of sampled candidates are drafted level by level with tree attention, which only the causal-LM
    # runner of the vanilla draft supports.
    Tree.MCSD: TreeFacts(
        "MCSD tree (2, 2, 1, ...) of sampled candidates", frozenset({Draft.VANILLA}), fixed_depth=3
    ),
    Tree.MCSD_TARGET: TreeFacts(
        "MCSD tree whose 2 roots the target seeds (exact greedy, BIASED at T > 0)",
        frozenset({Draft.VANILLA}),
        fixed_depth=4,  # the target's level and 3 drafted
        min_depth=2,
        adaptive=False,  # a stop policy learns from the drafted spine, whose first token is the target's
        suffix=False,  # the target seeds each round's roots, which suffix candidates would not follow
        lossless=False,
        remote=False,
    ),
}

_DRAFT_WORDS = {
    Draft.VANILLA: "separate draft model",
    Draft.GLIDE: "GliDe draft",
    Draft.EAGLE: "hidden-state draft",
}
_STOP_WORDS = {
    StopPolicyName.SVIP: "spine ended by SVIP (entropy > 0.6 nats)",
    StopPolicyName.ADAEDL: "spine ended by AdaEDL (adaptive entropy bound)",
    StopPolicyName.DECISION: "spine ended by the learned stopper (P(accept) <= 0.4)",
    StopPolicyName.COST: "depth and width chosen for expected tok/s (calibrated)",
    StopPolicyName.GATED: "the whole depth where a round of it pays in tok/s (calibrated), else none",
}

SYNTAX = (
    f"DRAFT[+TREE[-DEPTH]][+STOP][+suffix]: draft {', '.join(Draft)}; tree {', '.join(Tree)}; "
    f"stop {', '.join(StopPolicyName)} (e.g. eagle+cape+cost+suffix)"
)


@dataclass(frozen=True)
class MethodAxes:
    """One draft method's settings. Construct it (or `parse` a spelling) to validate them."""

    draft: Draft = Draft.NONE
    tree: Tree = Tree.CHAIN
    stop: StopPolicyName = StopPolicyName.FIXED
    suffix: bool = False
    # The most levels a round drafts; 0 = the tree's own, filled in here (so equal axes compare equal).
    depth: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("draft", Draft), ("tree", Tree), ("stop", StopPolicyName)):
            object.__setattr__(self, name, kind(getattr(self, name)))  # "glide" -> Draft.GLIDE
        fault = axes_fault(self.draft, self.tree, self.stop, self.suffix, self.depth)
        if fault is not None:
            raise InvalidArgument(f"method {self._written!r}: {fault}")
        if self.depth == 0 and self.draft is not Draft.NONE:
            object.__setattr__(self, "depth", self._default_depth)

    @classmethod
    def parse(cls, text: str) -> MethodAxes:
        """Axes from their spelling, DRAFT[+TREE[-DEPTH]][+STOP][+suffix] (InvalidArgument otherwise)."""
        parts = text.split("+")
        draft = _member(Draft, parts[0])
        if draft is None:
            reason = "names no draft first" if _known_part(parts[0]) else f"has an unknown part {parts[0]!r}"
            raise InvalidArgument(f"method {text!r} {reason}; a method's axes are {SYNTAX}")
        rest = parts[1:]
        tree = _tree_of(rest[0]) if rest else None
        rest = rest[tree is not None :]
        stop = _member(StopPolicyName, rest[0]) if rest else None
        rest = rest[stop is not None :]
        suffix = rest[:1] == ["suffix"]
        rest = rest[suffix:]
        if rest:
            reason = "out of order" if _known_part(rest[0]) else "unknown"
            raise InvalidArgument(
                f"method {text!r}: part {rest[0]!r} is {reason}; a method's axes are {SYNTAX}"
            )
        tree_kind, depth = tree if tree is not None else (Tree.CHAIN, None)
        policy = stop or StopPolicyName.FIXED
        fault = (
            "a depth must be >= 1" if depth == 0 else axes_fault(draft, tree_kind, policy, suffix, depth or 0)
        )
        if draft is Draft.NONE and (tree is not None or stop is not None):
            fault = _NO_DRAFT  # `none+chain` and `none+fixed` too: there is nothing to shape
        if fault is not None:
            raise InvalidArgument(f"method {text!r}: {fault}")
        return cls(draft, tree_kind, policy, suffix, depth or 0)

    @property
    def _default_depth(self) -> int:
        return TREES[self.tree].fixed_depth if self.stop.whole_depth else ADAPTIVE_DEPTH

    @property
    def _written(self) -> str:
        """Every axis as given, for messages about axes that are not valid."""
        depth = f"-{self.depth}" if self.depth else ""
        return f"{self.draft}+{self.tree}{depth}+{self.stop}" + ("+suffix" if self.suffix else "")

    @property
    def spelling(self) -> str:
        """The shortest spelling: defaults left out (`parse` reads it back to equal axes)."""
        parts = [str(self.draft)]
        if self.draft is not Draft.NONE:
            depth = "" if self.depth == self._default_depth else f"-{self.depth}"
            if self.tree is not Tree.CHAIN or depth:
                parts.append(f"{self.tree}{depth}")
            if self.stop.adaptive:
                parts.append(str(self.stop))
        if self.suffix:
            parts.append("suffix")
        return "+".join(parts)

    @property
    def drafts(self) -> bool:
        """Whether a draft model takes part (the router then needs a draft service)."""
        return self.draft is not Draft.NONE

    @property
    def hidden_states(self) -> bool:
        """The draft reads the target's final hidden states (the target keeps them, its feed carries them)."""
        return self.draft is Draft.EAGLE

    @property
    def lossless(self) -> bool:
        return not self.drafts or TREES[self.tree].lossless

    @property
    def remote(self) -> bool:
        """Whether the distributed stack serves these axes."""
        return not self.drafts or TREES[self.tree].remote

    def model(self) -> MethodAxes:
        """The same without suffix candidates: what a draft service runs behind the router's suffix index."""
        return MethodAxes(self.draft, self.tree, self.stop, depth=self.depth)

    def describe(self) -> str:
        """A one-line description, for axes no catalog name describes."""
        suffix = "suffix candidates merged in" if self.drafts else "suffix candidates of the session's text"
        if not self.drafts:
            return f"no draft model, {suffix}" if self.suffix else "no draft model: the target alone"
        bound = "" if self.stop.whole_depth else "<= "
        words = [_DRAFT_WORDS[self.draft], f"{TREES[self.tree].words}, depth {bound}{self.depth}"]
        words += [_STOP_WORDS[self.stop]] if self.stop in _STOP_WORDS else []
        return ", ".join(words + ([suffix] if self.suffix else []))


_NO_DRAFT = "without a draft model there is no tree, depth or stop policy"


def axes_fault(draft: Draft, tree: Tree, stop: StopPolicyName, suffix: bool, depth: int) -> str | None:
    """Why these axes cannot run together (None: they can). depth 0 = the tree's own."""
    if draft is Draft.NONE:
        return _NO_DRAFT if tree is not Tree.CHAIN or stop is not StopPolicyName.FIXED or depth else None
    facts = TREES[tree]
    if draft not in facts.drafts:
        return f"{tree} trees are drafted by the {' or '.join(sorted(facts.drafts))} draft only"
    if stop.adaptive and not facts.adaptive:
        return f"{tree} trees draft their whole depth: their stop policy is fixed"
    if suffix and not facts.suffix:
        return f"{tree} trees take no suffix candidates"
    if depth and not facts.min_depth <= depth <= MAX_DEPTH:
        return f"depth must be in [{facts.min_depth}, {MAX_DEPTH}] for {tree} trees, got {depth}"
    return None


def _member(kind: type[E], part: str) -> E | None:
    return next((member for member in kind if member == part), None)


def _tree_of(part: str) -> tuple[Tree, int | None] | None:
    """(tree, its depth if given) of a TREE[-DEPTH] part, else None."""
    tree = _member(Tree, part)
    if tree is not None:
        return tree, None
    name, _, depth = part.rpartition("-")
    tree = _member(Tree, name)
    return (tree, int(depth)) if tree is not None and depth.isascii() and depth.isdigit() else None


def _known_part(part: str) -> bool:
    return (
        any(_member(kind, part) for kind in (Draft, StopPolicyName))
        or bool(_tree_of(part))
        or part == "suffix"
    )
