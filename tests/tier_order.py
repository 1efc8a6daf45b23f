"""The order of the compute tier (tests/conftest.py sorts the collection by `compute_tier_rank`)."""

from __future__ import annotations

from typing import Protocol


class Collected(Protocol):
    """What the order reads of a collected test (a pytest Item)."""

    nodeid: str

    def get_closest_marker(self, name: str) -> object | None: ...


# The compute tier's longest modules, longest first (seconds of its two workers, 2026-11-29: 227, 109,
# 106, 95, 89, 84, 63, 60, 54). They run first: pytest-xdist's worksteal gives each worker a contiguous
# share of the collection and an idle worker takes tests from the end of another's queue, so what is
# left when the integration tier ends, beside which this tier runs, is short tests for both cores,
# not one long module on one core while the other idles. The rest keep their order after them.
COMPUTE_TIER_LONGEST = (
    "tests/specserve/test_methods.py",
    "tests/specserve/test_engine.py",
    "tests/specserve/runtime/test_mcsd.py",
    "tests/specserve/glide/test_glide_drafter.py",
    "tests/specserve/drafts/test_shipped_eagle_agreement.py",
    "tests/specserve/core/test_loop.py",
    "tests/specserve/test_engine_prefix_cache.py",
    "tests/specserve/drafts/test_shipped_drafts.py",
    "tests/specserve/runtime/test_cpu_kernels.py",
)


def compute_tier_rank(item: Collected) -> int:
    if item.get_closest_marker("compute_only") is None:
        return len(COMPUTE_TIER_LONGEST)
    path = item.nodeid.split("::")[0]
    return COMPUTE_TIER_LONGEST.index(path) if path in COMPUTE_TIER_LONGEST else len(COMPUTE_TIER_LONGEST)
