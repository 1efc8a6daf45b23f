"""One cost record for the suite's engines and stacks on the default model (and the tiny engine whose
methods' sampling is tested, test_methods.py), written instead of measured.

The cost policies choose a tree's size from recorded costs. Measured, those costs depend on the machine
and on its load while the suite runs: on the file's own weights the target's step is short enough that,
timed at an unlucky moment, a draft step costs half of it, and then drafting alone rightly does not pay.
Tests that assert what the policies do alone and under load (drafting alone, the root alone under a
heavy batch) read this record instead: a target step of 10 ms, flat to a few tokens and linear beyond,
and every draft kind at 1 ms a step. Reading one record also keeps the stack and the in-process engine
on the same costs (seeded sampling through the stack equals the in-process run), and the suite measures
nothing into the user's cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.core.cost import GLIDE_DRAFT, DraftCost, draft_costs_to_json
from specserve.drafts import DraftKind

STEP_S = 0.010  # one target forward of one token
FLAT_PER_TOKEN_S = 0.0001  # up to FLAT_TOKENS the forward streams the same weights
FLAT_TOKENS = 16
LINEAR_PER_TOKEN_S = 0.0006  # beyond, it computes
DRAFT = DraftCost(step_s=0.001, overhead_s=0.0003)
VERIFY_SIZES = (*range(1, FLAT_TOKENS + 1), 24, 32, 48, 64, 96, 128, 192, 256)


def verify_seconds(tokens: int) -> float:
    flat = STEP_S + FLAT_PER_TOKEN_S * (min(tokens, FLAT_TOKENS) - 1)
    return flat + LINEAR_PER_TOKEN_S * max(0, tokens - FLAT_TOKENS)


def write_pinned_costs(path: Path) -> Path:
    """A whole calibration record (the target's verify curve and every draft kind's step) at `path`."""
    kinds = {GLIDE_DRAFT, *(kind.value for kind in DraftKind)}
    record = {
        "verify_s": {str(n): verify_seconds(n) for n in VERIFY_SIZES},
        **draft_costs_to_json(dict.fromkeys(kinds, DRAFT)),
        "pinned": "tests/pinned_costs.py",
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def pinned_env(path: Path) -> dict[str, str]:
    """The environment that makes a stack's services read the record."""
    return {"SPECSERVE_CALIBRATION_PATH": str(path)}
