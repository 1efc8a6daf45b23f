"""Every combination of a method's four axes that can run, at each tree's own depth: what the axes tests,
the catalog's and the engine's, go through."""

from __future__ import annotations

import contextlib
import itertools

from specserve.core.stop_names import StopPolicyName
from specserve.errors import InvalidArgument
from specserve.method_axes import Draft, MethodAxes, Tree


def _valid() -> list[MethodAxes]:
    valid = []
    for draft, tree, stop, suffix in itertools.product(Draft, Tree, StopPolicyName, (False, True)):
        with contextlib.suppress(InvalidArgument):
            valid.append(MethodAxes(draft, tree, stop, suffix))
    return valid


VALID_AXES = _valid()
