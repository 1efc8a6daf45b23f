"""services/*/Dockerfile stay consistent with the package, the CLI, the settings and the chart.

No Docker engine runs here, so the Dockerfiles are read as text: the router image is the base install
only (no torch, no `model` extra); the GPU images pin torch exactly as pyproject.toml does and install it
first; CMD is a real `specserve serve <role>` command line; EXPOSE equals the settings' default ports;
the user is the numeric non-root id the chart runs as; everything copied exists and is not ignored.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from chart_support import CHART_DIR, REPO, container, deployment_for, render

from specserve.cli import build_parser
from specserve.serving.settings import DraftServiceSettings, RouterServiceSettings, TargetServiceSettings

ROLE_SETTINGS = {
    "target": TargetServiceSettings,
    "draft": DraftServiceSettings,
    "router": RouterServiceSettings,
}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


# The router's image has its own Dockerfile; target and draft share one, a final stage per role.
DOCKERFILES = {"router": "services/router/Dockerfile", "target": "services/model.Dockerfile"}
DOCKERFILES["draft"] = DOCKERFILES["target"]


def instructions(role: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with continuation lines joined and comments dropped: the stages the role's
    image is built from (`FROM x AS name` continues stage x), in order."""
    text = (REPO / DOCKERFILES[role]).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    preamble: list[tuple[str, str]] = []  # the ARGs before the first FROM
    stages: dict[str, list[tuple[str, str]]] = {}
    current = preamble
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            if keyword.upper() == "FROM":
                image, _, name = rest.partition(" AS ")
                current = [*stages.get(image.strip(), preamble), ("FROM", image.strip())]
                stages[name.strip() or role] = current
            else:
                current.append((keyword.upper(), " ".join(rest.split())))
    return stages[role]


def args_of(role: str, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(role) if kw == keyword]


def arg_default(role: str, name: str) -> str:
    (value,) = [rest.split("=", 1)[1] for rest in args_of(role, "ARG") if rest.startswith(name + "=")]
    return value


def pip_installs(role: str) -> list[str]:
    commands = [c.strip() for run in args_of(role, "RUN") for c in run.split("&&")]
    return [c for c in commands if c.startswith("pip install")]


def torch_pin() -> str:
    (pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["model"] if r.startswith("torch")]
    return pin.removeprefix("torch==")


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_cmd_is_a_serve_command_the_cli_accepts(role: str) -> None:
    (entrypoint,) = args_of(role, "ENTRYPOINT")
    (cmd,) = args_of(role, "CMD")
    argv = json.loads(entrypoint) + json.loads(cmd)  # exec form only (signals reach the process)
    assert argv == ["specserve", "serve", role]
    assert "specserve" in PYPROJECT["project"]["scripts"]
    parsed = build_parser().parse_args(argv[1:])
    assert (parsed.command, parsed.role) == ("serve", role)
    # The chart passes the same arguments (it relies on ENTRYPOINT being `specserve`).
    assert container(deployment_for(render(), role))["args"] == json.loads(cmd)


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_exposed_ports_are_the_settings_defaults(role: str) -> None:
    exposed = {int(p) for rest in args_of(role, "EXPOSE") for p in rest.split()}
    defaults = ROLE_SETTINGS[role]()
    assert exposed == {defaults.port, defaults.metrics_port}


def test_router_image_is_the_base_install_without_torch() -> None:
    assert pip_installs("router") == ["pip install ."]
    text = " ".join(rest for _, rest in instructions("router"))
    assert "torch" not in text.lower()
    assert "[model" not in text and "index-url" not in text


@pytest.mark.parametrize("role", ["target", "draft"])
def test_gpu_images_install_pinned_torch_first_then_the_model_extra(role: str) -> None:
    installs = pip_installs(role)
    assert installs[0] == 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"'
    assert installs[1] == 'pip install ".[model]"'
    assert arg_default(role, "TORCH_VERSION") == torch_pin()
    assert arg_default(role, "TORCH_INDEX_URL").endswith("/whl/cpu")  # CPU unless a CUDA index is chosen


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_runs_as_the_numeric_non_root_user_the_chart_expects(role: str) -> None:
    keywords = [kw for kw, _ in instructions(role)]
    (user,) = args_of(role, "USER")
    assert user.isdigit() and int(user) != 0
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN")
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values[role]["podSecurityContext"]["runAsUser"] == int(user)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(Path(prefix).name, bare):
                return True
    return False


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_copied_sources_exist_and_are_not_dockerignored(role: str) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [src for rest in args_of(role, "COPY") for src in rest.split()[:-1]]
    needed = {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"], "protos", "specserve"}
    assert needed <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert not _dockerignored(src, patterns), src
    for heavy in (".venv", ".git", "specserve/v1", "tests"):
        assert _dockerignored(heavy, patterns), heavy
    assert "grpcio-tools" in " ".join(PYPROJECT["build-system"]["requires"])  # protos compiled at build


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_modules_outside_the_package_are_shipped_on_the_pythonpath(role: str) -> None:
    """`specserve serve` imports services.<role>, which `pip install .` does not install (packages
    found: specserve*): the image must copy services/ and put its parent on PYTHONPATH."""
    packaged = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    if any(fnmatch.fnmatch("services", p) for p in packaged):
        return
    copies = {rest.split()[-2]: rest.split()[-1] for rest in args_of(role, "COPY")}
    destination = copies.get("services")
    assert destination, "services/ is not in the image"
    env = " ".join(args_of(role, "ENV"))
    assert f"PYTHONPATH={Path(destination).parent!s}" in env


# What each image installs, as specserve extras. The probe hides every installed distribution those
# extras do not declare, then imports the role's service module in a fresh interpreter: a hard dependency
# that only happens to be in the dev venv fails here, optional imports still work.
IMAGE_EXTRAS = {"router": set(), "target": {"model"}, "draft": {"model"}}
PROBE = Path(__file__).resolve().parent / "image_import_probe.py"


@pytest.mark.parametrize("role", list(IMAGE_EXTRAS))
def test_the_service_imports_with_only_what_its_image_installs(role: str) -> None:
    argv = [sys.executable, str(PROBE), role, ",".join(sorted(IMAGE_EXTRAS[role]))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the image's PYTHONPATH holds services/ likewise
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["error"] is None, f"{role} image (specserve{sorted(IMAGE_EXTRAS[role])}): {report['error']}"
    if role == "router":
        assert not report["torch"], "the router imported torch"
