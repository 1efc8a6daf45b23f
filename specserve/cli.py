"""`specserve` command line: generate, bench, calibrate, models, train-draft, train-stopper, eval-draft.

Errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.catalog import DEFAULT_METHOD
from specserve.core.request import GenerationRequest
from specserve.errors import SpecserveError
from specserve.settings import DRAFT_WEIGHTS, INT4_KERNELS, WEIGHTS, EngineSettings

if TYPE_CHECKING:
    from specserve.models.profiles import ModelProfile

EXIT_USAGE = 2


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    from specserve.app.model_args import add_model_option

    group = parser.add_argument_group("engine (defaults from SPECSERVE_* variables)")
    add_model_option(group)
    group.add_argument(
        "--model-dir", type=Path, help="local Hugging Face model directory (overrides --model)"
    )
    group.add_argument("--draft-dir", type=Path, help="draft model directory for the vanilla methods")
    group.add_argument(
        "--draft-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="that draft model's dtype (default: the profile's for its own draft, else --dtype)",
    )
    group.add_argument(
        "--draft-head-rows",
        type=int,
        help="that draft's LM head scores only the first N token ids and the special tokens "
        "(default: the profile's for its own draft; 0 = the whole head)",
    )
    group.add_argument("--device", help="torch device, e.g. cpu or cuda")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    group.add_argument(
        "--linear-kernel",
        choices=["auto", "onednn", "native"],
        help="linear layers' matrix kernel: auto (packed oneDNN on CPU, cuBLAS on CUDA), onednn, native",
    )
    group.add_argument(
        "--weights",
        choices=WEIGHTS,
        help="the target's weights: dense (the converted checkpoint in --dtype), as-shipped (the model "
        "file's own 4-bit codes) or auto (as-shipped on a CPU with AVX512-VNNI in float32, else dense)",
    )
    group.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        help="the drafts' weights: auto (the profile's choice beside its file's weights, the default), dense "
        "(as trained; a separate draft on its file's weights), int8 (one-layer drafts rounded per group of "
        "32: a cheaper step, fewer drafts accepted) or int4 (every draft rounded to 4 bits per group of 32, "
        "a separate draft's embedding and head too); lossless either way",
    )
    group.add_argument(
        "--int4-kernel",
        choices=INT4_KERNELS,
        help="the kernel of weights as shipped: int8-dot (CPU: rows in int8, one pass over the weights for "
        "all rows), torch (torch's int4 kernel, bfloat16 rows) or auto (int8-dot on a CPU where it builds)",
    )


def build_parser() -> argparse.ArgumentParser:
    from specserve.app.sampling_args import add_constraint_options, add_sampling_options
    from specserve.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one chat prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument(
        "--method",
        help=f"draft method, a name or axes such as eagle+cape+svip (default: the model's own, "
        f"{DEFAULT_METHOD} for the default model; with --remote, the router's; see `specserve methods`)",
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("--remote", metavar="HOST:PORT", help="generate through a router (client SDK)")
    gen.add_argument("--token", help="--remote: bearer token (default: $SPECSERVE_TOKEN)")
    gen.add_argument("--tls", action="store_true", help="--remote: TLS with the system's roots")
    gen.add_argument("--tls-ca", metavar="FILE", help="--remote: TLS, verifying the router with this CA")
    gen.add_argument("--tls-cert", metavar="FILE", help="--remote: a client certificate, if asked for")
    gen.add_argument("--tls-key", metavar="FILE", help="--remote: its key")
    add_sampling_options(gen, default_seed=None)
    add_constraint_options(gen)
    _add_engine_options(gen)

    sub.add_parser("methods", help="list the draft methods")
    _add_models_parser(sub)

    calibrate = sub.add_parser("calibrate", help="measure target verify and draft step costs (cost policy)")
    calibrate.add_argument("--out", type=Path, help="json path (default: the engine's calibration_path)")
    calibrate.add_argument("--plot", type=Path, help="PNG of verify cost in one-token steps by tree size")
    calibrate.add_argument(
        "--compare", type=Path, nargs="*", default=[], help="other calibration files drawn beside this one"
    )
    _add_engine_options(calibrate)

    bench = add_bench_parser(sub)
    _add_engine_options(bench)

    from specserve.training.cli import add_eval_draft_parser, add_train_parser, add_train_stopper_parser

    add_train_parser(sub)
    add_train_stopper_parser(sub)
    add_eval_draft_parser(sub)

    from specserve.app.serve import add_serve_parsers

    add_serve_parsers(sub)
    return parser


def _add_models_parser(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="list or install model profiles (--model NAME selects one)")
    actions = models.add_subparsers(dest="models_command", required=True)
    actions.add_parser("list", help="every profile: installed or not, size, the default marked")
    install = actions.add_parser(
        "install",
        help="pip-install a profile's hash-pinned wheels (and its draft's), check and convert its GGUF once",
    )
    install.add_argument("name", help="a profile name (`specserve models list`)")


def _settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings.from_env(
        model=getattr(args, "model", None),
        model_dir=getattr(args, "model_dir", None),
        draft_dir=getattr(args, "draft_dir", None),
        draft_dtype=getattr(args, "draft_dtype", None),
        draft_head_rows=getattr(args, "draft_head_rows", None),
        device=getattr(args, "device", None),
        dtype=getattr(args, "dtype", None),
        linear_kernel=getattr(args, "linear_kernel", None),
        weights=getattr(args, "weights", None),
        int4_kernel=getattr(args, "int4_kernel", None),
        draft_weights=getattr(args, "draft_weights", None),
    )


def _run_generate(args: argparse.Namespace) -> int:
    from specserve.app.sampling_args import request_from_args
    from specserve.core.request import RequestLimits

    if args.remote:  # the router checks the model's bounds too
        request = request_from_args(args, RequestLimits())
        if args.method is None:  # "" asks for the router's default method
            request = dataclasses.replace(request, method="")
        return _run_remote_generate(args, request)
    from specserve.engine import Engine, request_limits
    from specserve.models.profiles import model_profile

    settings = _settings(args)
    if args.method is None:
        args.method = model_profile(settings.model).default_method
    request = request_from_args(args, request_limits(settings))  # fails before any model loads
    engine = Engine(settings)
    if args.json:
        result = engine.generate(args.prompt, request)
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason.value,
                    "method": args.method,
                    "stats": result.stats.to_dict(),
                }
            )
        )
        return 0
    holdback = max((len(s) for s in request.stopping.stop), default=1) - 1
    printer = _StreamPrinter(engine.decode, holdback)
    result = engine.generate(args.prompt, request, on_tokens=printer.add)
    printer.finish(result.text)
    stats = result.stats
    acceptance = f"{stats.acceptance_rate:.2f}" if stats.acceptance_rate is not None else "-"
    print(
        f"[{args.method}] {stats.num_generated_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
        f"{stats.mean_accepted_length:.2f} tokens/forward, acceptance {acceptance}, "
        f"finish: {result.finish_reason.value}",
        file=sys.stderr,
    )
    return 0


def _run_remote_generate(args: argparse.Namespace, request: GenerationRequest) -> int:
    from specserve.bench.remote import client_options
    from specserve.client import Client

    options = client_options(request)
    security = {
        "token": args.token or os.environ.get("SPECSERVE_TOKEN") or None,
        "tls": args.tls,
        "tls_ca_file": args.tls_ca,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
    }
    with Client(args.remote, **security) as client:
        if args.json:
            done = client.generate(args.prompt, **options)
            print(
                json.dumps(
                    {
                        "text": done.text,
                        "token_ids": done.token_ids,
                        "finish_reason": done.finish_reason,
                        "method": args.method,
                        "session_id": done.session_id,
                        "stats": done.stats,
                    }
                )
            )
            return 0
        last = None
        for chunk in client.stream(args.prompt, **options):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    stats = last.stats if last is not None else {}
    print(
        f"\n[{args.method} via {args.remote}] {int(stats.get('num_generated_tokens', 0))} tokens, "
        f"{stats.get('tokens_per_second', 0.0):.1f} tok/s, {stats.get('mean_accepted_length', 0.0):.2f} "
        f"tokens/round, finish: {last.finish_reason if last else '-'}",
        file=sys.stderr,
    )
    return 0


class _StreamPrinter:
    """Prints decoded text as tokens arrive, never a half UTF-8 character or a possible stop string."""

    def __init__(self, decode, holdback: int) -> None:
        self.decode = decode
        self.holdback = holdback
        self.token_ids: list[int] = []
        self.printed = 0

    def add(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        text = self.decode(self.token_ids)
        end = len(text) - self.holdback
        while end > self.printed and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.printed:
            sys.stdout.write(text[self.printed : end])
            sys.stdout.flush()
            self.printed = end

    def finish(self, final_text: str) -> None:
        sys.stdout.write(final_text[self.printed :] + "\n")
        sys.stdout.flush()


def _run_calibrate(args: argparse.Namespace) -> int:
    from specserve.bench.report import plot_verify_curves, verify_in_steps
    from specserve.engine import Engine
    from specserve.runtime.calibrate import VERIFY_SIZES, save_calibration

    engine = Engine(_settings(args))
    cost = engine.calibrate()
    about = engine.calibration_about()
    path = save_calibration(cost, args.out or engine.calibration_path, about)
    single = {n: s for n, s in cost.verify_points if n <= max(VERIFY_SIZES)}  # one session's trees
    steps = {n: round(v, 3) for n, v in verify_in_steps(single).items()}
    print(json.dumps({"path": str(path), **about, **cost.to_json(), "verify_in_steps": steps}))
    if args.plot is not None:
        curves = {_curve_label(_weights_kernel(about), about["forward"], single): single}
        for other in args.compare:
            record = json.loads(other.read_text())
            points = {int(n): s for n, s in record["verify_s"].items() if int(n) <= max(VERIFY_SIZES)}
            curves[_curve_label(_weights_kernel(record), record.get("forward", "transformers"), points)] = (
                points
            )
        plot_verify_curves(curves, args.plot)
    return 0


def _weights_kernel(record: dict) -> str:
    """What a calibration's linear layers ran on: the 4-bit kernel for weights as shipped, else the linear
    kernel."""
    if record.get("weights") == "as-shipped":
        kernel = record.get("int4_kernel")
        return f"int4 {kernel if kernel not in (None, '-') else 'torch'}"
    return record.get("linear_kernel", "native")


def _curve_label(kernel: str, forward: str, verify_s: dict[int, float]) -> str:
    return f"{kernel} kernel, {forward} forward (1 step = {1e3 * verify_s[min(verify_s)]:.1f} ms)"


def _run_methods() -> int:
    from specserve.catalog import CATALOG
    from specserve.method_axes import SYNTAX
    from specserve.models.profiles import model_profile

    default = model_profile(EngineSettings.from_env().model).default_method  # SPECSERVE_MODEL's
    print(f"{'NAME':19s} {'AXES':24s} DESCRIPTION")
    for info in CATALOG.values():
        label = "" if info.lossless else "  [LOSSY: opt-in]"
        if info.name == default:
            label += "  (default)"
        axes = info.axes_spelling or "(transformers)"
        print(f"{info.name:19s} {axes:24s} {info.description}{label}")
    print(f"\n--method takes a name or any valid axes, {SYNTAX}.")
    return 0


def _run_models(args: argparse.Namespace) -> int:
    from specserve.models.install import install_profile
    from specserve.models.profiles import PROFILES, model_profile

    cache_dir = EngineSettings.from_env().cache_dir
    if args.models_command == "install":
        install_profile(model_profile(args.name), cache_dir)
        return 0
    print(f"{'NAME':30s} {'INSTALLED':9s} {'SIZE':>9s}  NOTES")
    for profile in PROFILES.values():
        print(_profile_row(profile, cache_dir))
    return 0


def _profile_row(profile: ModelProfile, cache_dir: Path) -> str:
    """One `models list` line: the size on disk once installed, else the GGUF file's (what pip fetches)."""
    from specserve.models.install import installed_dir, is_installed
    from specserve.models.profiles import DEFAULT_PROFILE

    installed = is_installed(profile, cache_dir)
    directory = installed_dir(profile, cache_dir)
    size = (
        sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if installed else profile.gguf_size
    )
    notes = [] if installed else ["size of the GGUF file", f"install: {profile.install_command}"]
    notes += [f"draft {profile.draft} ({profile.draft_dtype or 'same dtype'})"] if profile.draft else []
    notes += ["default"] if profile.name == DEFAULT_PROFILE else []
    row = f"{profile.name:30s} {'yes' if installed else 'no':9s} {size / 1e9:6.2f} GB  {'; '.join(notes)}"
    return row.rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "methods":
            return _run_methods()
        if args.command == "models":
            return _run_models(args)
        if args.command == "calibrate":
            return _run_calibrate(args)
        if args.command in ("serve", "stack"):
            from specserve.app.serve import run_serve, run_stack

            return run_serve(args) if args.command == "serve" else run_stack(args)
        if args.command == "train-draft":
            from specserve.training.cli import run_train_command

            return run_train_command(args)
        if args.command == "train-stopper":
            from specserve.training.stopper import run_train_stopper_command

            return run_train_stopper_command(args)
        if args.command == "eval-draft":
            from specserve.training.cli import run_eval_draft_command

            return run_eval_draft_command(args)
        from specserve.bench.cli import run_bench_command

        return run_bench_command(args, _settings(args))
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
