"""Imports `services.<role>.main` as it would run in that role's image: every installed distribution
that `specserve[<extras>]` does not declare (transitively) is made invisible to the import system.

    python tests/helm/image_import_probe.py ROLE EXTRAS   # EXTRAS comma-separated, "" for none

Prints one JSON object: {"error": null or the first missing module, "torch": imported or not}.
Optional imports (try/except ImportError, find_spec probes) behave as they would in the image.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata as md
import json
import re
import sys

_ALWAYS_VISIBLE = ("specserve", "services")  # the image's own code


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_closure(dist: str, extras: set[str], seen: set[str]) -> set[str]:
    """Canonical names of `dist[extras]` and everything it requires, as installed here."""
    if canon(dist) in seen:
        return seen
    seen.add(canon(dist))
    try:
        requirements = md.requires(dist) or []
    except md.PackageNotFoundError:
        return seen
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        wanted = re.findall(r'extra\s*==\s*"([^"]+)"', marker)
        if wanted and not set(wanted) & extras:
            continue
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[([^\]]*)\])?", spec)
        sub_extras = {e.strip() for e in (match.group(3) or "").split(",") if e.strip()}
        declared_closure(match.group(1), sub_extras, seen)
    return seen


def hide_undeclared(declared: set[str]) -> dict[str, list[str]]:
    """Replaces the path finder with one that cannot see undeclared distributions. Returns the record
    of hidden module names it was asked for (name -> distributions)."""
    hidden_tops: dict[str, list[str]] = {}
    hidden_files: dict[str, str] = {}
    for top, dists in md.packages_distributions().items():
        undeclared = [d for d in dists if canon(d) not in declared]
        if top in _ALWAYS_VISIBLE or not undeclared:
            continue
        if len(undeclared) == len(dists):
            hidden_tops[top] = sorted(dists)
        else:  # a namespace shared with declared distributions (opentelemetry, google): hide by file
            for dist in undeclared:
                for file in md.files(dist) or []:
                    hidden_files[str(file.locate())] = dist
    asked: dict[str, list[str]] = {}

    class HidingPathFinder(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            owner = hidden_tops.get(name.split(".")[0])
            spec = None if owner else importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.origin in hidden_files:
                owner, spec = [hidden_files[spec.origin]], None
            if owner:
                asked.setdefault(name, owner)
            return spec

    sys.meta_path[:] = [HidingPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    return asked


def main(role: str, extras: str) -> dict[str, object]:
    declared = declared_closure("specserve", set(extras.split(",")) - {""}, set())
    asked = hide_undeclared(declared)
    error = None
    try:
        importlib.import_module(f"services.{role}.main")
    except ImportError as e:
        while e.__cause__ is not None:  # lazy importers (transformers) re-raise "from" the real error
            e = e.__cause__
        owner = asked.get(getattr(e, "name", None) or "", "?")
        error = f"{type(e).__name__}: {e} (distribution {owner}, not declared for this image)"
    return {"error": error, "torch": "torch" in sys.modules}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
