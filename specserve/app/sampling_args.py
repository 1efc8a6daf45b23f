"""The command-line options of a generation and the one GenerationRequest they build, for every command
that generates (`generate`, locally or through a router, and `bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.catalog import Method
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest, RequestLimits
from specserve.errors import InvalidArgument


def add_sampling_options(parser: argparse.ArgumentParser, default_seed: int | None) -> None:
    """Sampling, the token budget, the seed and the lossy opt-in; each command adds its own extras."""
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=default_seed, metavar="S")
    parser.add_argument(
        "--allow-lossy",
        action="store_true",
        help="let a lossy method (see `specserve methods`) sample at T > 0, where its output is biased",
    )


def add_constraint_options(parser: argparse.ArgumentParser) -> None:
    """At most one language the text must belong to (core/constraint.py)."""
    group = parser.add_argument_group("constraint (the text must belong to this language)")
    options = group.add_mutually_exclusive_group()
    options.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="JSON valid against this JSON Schema"
    )
    options.add_argument("--json-object", action="store_true", help="any JSON object")
    options.add_argument("--regex", metavar="REGEX", help="text the regular expression matches as a whole")
    options.add_argument("--grammar", type=Path, metavar="FILE", help="a Lark grammar (llguidance's dialect)")


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The constraint the options name; None without one (or for a command without the options)."""
    if getattr(args, "json_object", False):
        return Constraint(ConstraintKind.JSON_OBJECT)
    if getattr(args, "regex", None) is not None:
        return Constraint(ConstraintKind.REGEX, args.regex)
    for option, kind in (("json_schema", ConstraintKind.JSON_SCHEMA), ("grammar", ConstraintKind.GRAMMAR)):
        path = getattr(args, option, None)
        if path is not None:
            try:
                # the file's text as written: a schema's properties are generated in its order
                return Constraint(kind, path.read_text())
            except OSError as e:
                raise InvalidArgument(
                    f"--{option.replace('_', '-')}: cannot read {path}: {e.strerror}"
                ) from None
    return None


def request_from_args(args: argparse.Namespace, limits: RequestLimits) -> GenerationRequest:
    """The validated request of a command line; options a command does not have keep their defaults.
    `bench` runs several methods: its request names the target, and each run names its own method."""
    return GenerationRequest.build(
        method=getattr(args, "method", None) or Method.TARGET,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop=getattr(args, "stop", ()),
        ignore_eos=getattr(args, "ignore_eos", False),
        seed=args.seed,
        allow_lossy=args.allow_lossy,
        constraint=constraint_from_args(args),
        limits=limits,
    )
