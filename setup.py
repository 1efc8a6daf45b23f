"""Generates specserve/v1/*_pb2*.py from protos/ with grpcio-tools before the package is built (wheel and
editable installs alike); the generated code is never committed. Everything else is in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    proto_root = ROOT / "protos"
    sources = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "specserve").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = ["protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}"]
    args += [f"--grpc_python_out={ROOT}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    for package in {(ROOT / s).parent for s in sources}:
        (package / "__init__.py").touch()


class BuildWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
