"""Bad values are refused before anything is rendered: by values.schema.json (types, port ranges,
enums, unknown keys) and by the templates' own checks, with a message naming the offending key."""

from __future__ import annotations

import json

import pytest
from chart_support import CHART_DIR, CI_DIR, KUBE_VERSION, render_result, run_helm

# (--set arguments, fragments the error must contain)
SCHEMA_REJECTS = {
    "port above 65535": (["target.settings.port=70000"], ["/target/settings/port", "maximum"]),
    "port zero": (["router.settings.port=0"], ["/router/settings/port", "minimum"]),
    "negative metrics port": (["draft.settings.metricsPort=-1"], ["/draft/settings/metricsPort", "minimum"]),
    "redis port out of range": (["redis.bundled.port=65536"], ["/redis/bundled/port", "maximum"]),
    "replicas as a word": (["target.replicaCount=two"], ["/target/replicaCount", "integer"]),
    "drain as a word": (["router.settings.drainSeconds=soon"], ["/router/settings/drainSeconds", "number"]),
    "gpu count as a word": (["draft.gpu.count=one"], ["/draft/gpu/count", "integer"]),
    "unknown role key": (["target.replica=2"], ["/target", "additional properties 'replica'"]),
    "misspelt setting": (["target.settings.maxSesions=8"], ["/target/settings", "'maxSesions'"]),
    "unknown top-level key": (["tracing.endpoint=x"], ["additional properties 'tracing'"]),
    "router has no gpu": (["router.gpu.count=1"], ["/router", "additional properties 'gpu'"]),
    "redis url is a redis setting, not a router one": (
        ["router.settings.redisUrl=redis://x:6379/0"],
        ["/router/settings", "'redisUrl'"],
    ),
    "dtype enum": (["engine.dtype=int8"], ["/engine/dtype"]),
    "unknown model profile": (["engine.model=llama-70b"], ["/engine/model"]),
    "redis mode enum": (["redis.mode=cluster"], ["/redis/mode"]),
    "traces exporter enum": (["otel.tracesExporter=jaeger"], ["/otel/tracesExporter"]),
    "router service type enum": (["router.service.type=Ingress"], ["/router/service/type"]),
    "external redis without url or secret": (["redis.mode=external"], ["/redis/external"]),
    "pvc without a claim": (
        ["models.source=persistentVolumeClaim"],
        ["/models/persistentVolumeClaim/claimName"],
    ),
    "relative model dir": (["engine.modelDir=models/target"], ["/engine/modelDir"]),
    "validity as a word": (["tls.generated.validityDays=long"], ["/tls/generated/validityDays", "integer"]),
    "router name with a space": (
        ["tls.generated.routerDnsNames={api example.com}"],
        ["/tls/generated/routerDnsNames/0"],
    ),
    "address without port": (
        ["router.settings.targetAddresses={target.example}"],
        ["/router/settings/targetAddresses/0"],
    ),
}

TEMPLATE_REJECTS = {
    "autoscaling without a metric": (
        ["target.autoscaling.enabled=true"],
        ["target.autoscaling.enabled needs targetCPUUtilizationPercentage or metrics"],
    ),
    "cpu autoscaling without a cpu request": (
        ["router.autoscaling.enabled=true"],
        ["router.autoscaling.targetCPUUtilizationPercentage needs router.resources.requests.cpu"],
    ),
    "max below min replicas": (
        [
            "router.autoscaling.enabled=true",
            "router.resources.requests.cpu=1",
            "router.autoscaling.maxReplicas=1",
            "router.autoscaling.minReplicas=3",
        ],
        ["router.autoscaling.maxReplicas must be >= minReplicas"],
    ),
    # The router's one certificate is checked by the target and draft, theirs by the router: one CA.
    "some TLS Secrets yours, some generated": (
        ["tls.secrets.router=public-cert"],
        ["tls.secrets names router only", "or none to have the chart generate them"],
    ),
}


def _set_args(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.parametrize("case", list(SCHEMA_REJECTS))
def test_schema_rejects_bad_values_in_template_and_lint(case: str) -> None:
    set_values, fragments = SCHEMA_REJECTS[case]
    result = render_result(set_values=set_values)
    assert result.returncode != 0, f"{case}: rendered anyway"
    assert "don't meet the specifications of the schema" in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    lint = run_helm(
        "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART_DIR), *_set_args(set_values)
    )
    assert lint.returncode != 0, f"{case}: lint passed"
    for fragment in fragments:
        assert fragment in lint.stdout + lint.stderr


@pytest.mark.parametrize("case", list(TEMPLATE_REJECTS))
def test_templates_reject_inconsistent_values(case: str) -> None:
    set_values, fragments = TEMPLATE_REJECTS[case]
    result = render_result(set_values=set_values)
    assert result.returncode != 0, f"{case}: rendered anyway"
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_the_same_keys_are_accepted_when_valid() -> None:
    """The rejections above are about the values, not the keys: in range and well typed, they render."""
    good = [
        "target.settings.port=60000",
        "draft.settings.metricsPort=0",
        "target.replicaCount=2",
        "engine.dtype=float16",
        "router.settings.targetAddresses={target-a.example:50051,dns:///target-b.example:50051}",
        "models.source=persistentVolumeClaim",
        "models.persistentVolumeClaim.claimName=models",
    ]
    result = render_result([CI_DIR / "gpu-values.yaml"], good)
    assert result.returncode == 0, result.stderr


def test_schema_is_strict_where_it_matters() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    for role in ("target", "draft", "router"):
        role_schema = schema["properties"][role]
        assert role_schema["additionalProperties"] is False
        assert role_schema["properties"]["settings"]["additionalProperties"] is False
        port = role_schema["properties"]["settings"]["properties"]["port"]
        assert (port["minimum"], port["maximum"]) == (1, 65535)
