"""The compute tier's order (tests/tier_order.py, applied by tests/conftest.py): its longest modules run
first, in their order, and every module named there still holds compute-tier tests (a renamed one would
silently drop out)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tier_order import COMPUTE_TIER_LONGEST, compute_tier_rank

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Collected:
    """What the ordering reads of a collected test: its id and whether it is marked compute_only."""

    nodeid: str
    compute: bool

    def get_closest_marker(self, name: str) -> object | None:
        return object() if self.compute and name == "compute_only" else None


def test_every_module_named_longest_holds_compute_tier_tests() -> None:
    for path in COMPUTE_TIER_LONGEST:
        assert "compute_only" in (ROOT / path).read_text(encoding="utf-8"), path


def test_the_longest_compute_modules_come_first_and_the_rest_keep_their_order() -> None:
    first, second = COMPUTE_TIER_LONGEST[0], COMPUTE_TIER_LONGEST[1]
    items = [
        Collected("tests/a_test.py::unit", False),
        Collected(f"{second}::b", True),
        Collected("tests/b_test.py::short_compute", True),
        Collected(f"{first}::a", True),
        Collected(f"{second}::a", True),
        Collected("tests/c_test.py::unit", False),
        Collected(f"{first}::not_compute", False),
    ]
    items.sort(key=compute_tier_rank)
    assert [item.nodeid for item in items] == [
        f"{first}::a",
        f"{second}::b",
        f"{second}::a",
        "tests/a_test.py::unit",
        "tests/b_test.py::short_compute",
        "tests/c_test.py::unit",
        f"{first}::not_compute",
    ]
