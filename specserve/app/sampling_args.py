"""The command-line options of a generation and the one GenerationRequest they build, for every command
that generates (`generate`, locally or through a router, and `bench`)."""

from __future__ import annotations

import argparse

from specserve.catalog import Method
from specserve.core.request import GenerationRequest, RequestLimits


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
        limits=limits,
    )
