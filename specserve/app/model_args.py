"""`--model NAME`, the model profile option of every command that loads a target (SPECSERVE_MODEL)."""

from __future__ import annotations

import argparse

from specserve.models.profiles import DEFAULT_PROFILE, PROFILES


def add_model_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """None when not given, so that SPECSERVE_MODEL and then the settings' default apply."""
    parser.add_argument(
        "--model",
        choices=list(PROFILES),
        metavar="NAME",
        help=f"model profile: {', '.join(PROFILES)} (default {DEFAULT_PROFILE}; `specserve models list`); "
        "--model-dir overrides it",
    )
