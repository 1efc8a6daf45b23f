"""Command-line sampling options -> one validated SamplingParams, for every command that generates."""

from __future__ import annotations

import argparse

from specserve.core.sampling_params import SamplingParams


def sampling_params_from_args(args: argparse.Namespace, max_new_tokens_limit: int) -> SamplingParams:
    """The options `generate` and `bench` share; those a command does not have keep their defaults."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(getattr(args, "stop", ())),
        ignore_eos=getattr(args, "ignore_eos", False),
        allow_lossy=getattr(args, "allow_lossy", False),
    ).validate(max_new_tokens_limit)
