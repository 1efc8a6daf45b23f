"""The draft methods' names and facts, without their implementations: torch-free, so the router can
validate and list methods. `specserve.methods` binds each name to its drafter factory."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Method(StrEnum):
    TARGET = "target"  # the target alone on our engine: the speedup baseline
    HF = "hf"  # transformers `generate`: the reference implementation
    HF_PLD = "hf-pld"  # transformers `generate` with prompt lookup decoding: the training-free peer
    VANILLA = "vanilla"  # a separate small causal LM drafting a chain
    VANILLA_TREE = "vanilla-tree"  # the same draft, top-2 leaves at the first two depths
    VANILLA_CAPE_SVIP = "vanilla-cape-svip"  # the same draft + CaPE, spine length by SVIP's entropy rule
    VANILLA_CAPE_COST = "vanilla-cape-cost"  # the same draft, CaPE trees sized for expected tokens/s
    VANILLA_CAPE_SUFFIX = "vanilla-cape-suffix"  # suffix candidates merged with vanilla-cape-cost's tree
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


@dataclass(frozen=True)
class MethodInfo:
    method: Method
    description: str
    lossless: bool = True
    uses_hf_generate: bool = False  # in-process only: bypasses the speculative loop
    drafts: bool = True  # False: the target alone (no draft service involved)
    # Served by the distributed stack. Target-initialised roots need the target's top-W sent back with
    # each verification, which the v1 protocol does not carry yet: in-process only.
    remote: bool = True
    # Suffix candidates (core/suffix_drafter.py) are merged into the rounds; with `model_method` set, into
    # that method's draft trees (the draft service runs that method), else they are the only drafts.
    suffix: bool = False
    model_method: Method | None = None
    # The draft reads the target's final hidden states (specserve/eagle): the target keeps them for the
    # session and its KV feed carries them.
    hidden_states: bool = False


# transformers' documented setting for prompt lookup decoding (`prompt_lookup_num_tokens`).
HF_PROMPT_LOOKUP_TOKENS = 10

# GliDe was trained for a target cache up to 5 tokens stale; adaptive policies may draft up to 8 when sure.
ADAPTIVE_DEPTH = 8


CATALOG: dict[Method, MethodInfo] = {
    info.method: info
    for info in (
        MethodInfo(Method.TARGET, "target alone, plain decoding on the specserve engine", drafts=False),
        MethodInfo(Method.HF, "transformers generate (reference)", uses_hf_generate=True, drafts=False),
        MethodInfo(
            Method.HF_PLD,
            f"transformers generate, prompt lookup of {HF_PROMPT_LOOKUP_TOKENS} tokens (the peer of suffix)",
            uses_hf_generate=True,
            drafts=False,
            remote=False,
        ),
        MethodInfo(
            Method.HF_ASSISTED,
            "transformers generate, the vanilla draft model as assistant_model (the peer of vanilla)",
            uses_hf_generate=True,
            drafts=False,
            remote=False,
        ),
        MethodInfo(Method.VANILLA, "separate draft model, chain of 4"),
        MethodInfo(Method.VANILLA_TREE, "separate draft model, chain of 4 with top-2 leaves at depths 1-2"),
        MethodInfo(
            Method.VANILLA_CAPE_SVIP,
            f"separate draft model + CaPE, depth <= {ADAPTIVE_DEPTH} by SVIP's entropy rule",
        ),
        MethodInfo(
            Method.VANILLA_CAPE_COST,
            f"separate draft model + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s",
        ),
        MethodInfo(
            Method.VANILLA_CAPE_SUFFIX,
            "suffix candidates merged with vanilla-cape-cost's tree; suffix-only rounds skip the draft",
            suffix=True,
            model_method=Method.VANILLA_CAPE_COST,
        ),
        MethodInfo(Method.GLIDE, "GliDe draft glimpsing the target's KV cache, chain of 4"),
        MethodInfo(
            Method.GLIDE_CAPE,
            "GliDe draft, depth 4, CaPE top-k leaves by confidence (<= max_tree_nodes nodes)",
        ),
        MethodInfo(Method.GLIDE_CAPE_1, "GliDe draft, depth 1, CaPE top-k leaves by confidence"),
        MethodInfo(Method.GLIDE_CAPE_2, "GliDe draft, depth 2, CaPE top-k leaves by confidence"),
        MethodInfo(
            Method.GLIDE_CAPE_SVIP,
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by SVIP (entropy > 0.6 nats)",
        ),
        MethodInfo(
            Method.GLIDE_CAPE_ADAEDL,
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by AdaEDL (adaptive entropy bound)",
        ),
        MethodInfo(
            Method.GLIDE_CAPE_DECISION,
            f"GliDe + CaPE, spine <= {ADAPTIVE_DEPTH} ended by the learned stopper (P(accept) <= 0.4)",
        ),
        MethodInfo(
            Method.GLIDE_CAPE_COST,
            f"GliDe + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s (calibrated)",
        ),
        MethodInfo(
            Method.MCSD,
            "separate draft, MCSD tree (2, 2, 1) of sampled candidates, lossless multi-candidate rule",
        ),
        MethodInfo(
            Method.MCSD_TARGET_INIT,
            "target seeds 2 roots, draft tree (2, 1, 1) under each; exact greedy, BIASED at T > 0",
            lossless=False,
            remote=False,
        ),
        MethodInfo(
            Method.SUFFIX,
            "no draft model: continuations of the session's own earlier text (suffix index), sized by cost",
            drafts=False,
            suffix=True,
        ),
        MethodInfo(
            Method.GLIDE_CAPE_SUFFIX,
            "suffix candidates merged with glide-cape-cost's tree; suffix-only rounds skip the draft",
            suffix=True,
            model_method=Method.GLIDE_CAPE_COST,
        ),
        MethodInfo(
            Method.EAGLE,
            "hidden-state draft reading the target's final hidden states, chain of 4",
            hidden_states=True,
        ),
        MethodInfo(
            Method.EAGLE_CAPE,
            "hidden-state draft, depth 4, CaPE top-k leaves by confidence (<= max_tree_nodes nodes)",
            hidden_states=True,
        ),
        MethodInfo(
            Method.EAGLE_CAPE_COST,
            f"hidden-state draft + CaPE, depth <= {ADAPTIVE_DEPTH} and width chosen for expected tok/s",
            hidden_states=True,
        ),
        MethodInfo(
            Method.EAGLE_CAPE_SUFFIX,
            "suffix candidates merged with eagle-cape-cost's tree; suffix-only rounds skip the draft",
            suffix=True,
            model_method=Method.EAGLE_CAPE_COST,
            hidden_states=True,
        ),
    )
}
