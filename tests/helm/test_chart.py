"""The specserve chart, rendered by the real (pinned) helm: lint, Kubernetes schemas, and what the
manifests must say to work together (probes, selectors, HPAs, Service names the router resolves)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_support import (
    CHART_DIR,
    CI_DIR,
    GPU_ROLES,
    GRPC_SERVICE,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    ROLES,
    by_kind,
    component,
    container,
    deployment_for,
    env_of,
    iter_pod_specs,
    pod_labels,
    render,
    render_result,
    run_helm,
    selects,
    validate_manifest,
)

VALUE_SETS = {
    "default": None,
    **{path.stem: path for path in sorted(CI_DIR.glob("*.yaml"))},
}
EXPECTED_CI_FILES = {"gpu-values", "external-redis-values", "autoscaling-on-values", "autoscaling-off-values"}


def _effective_values(values_file: Path | None) -> dict[str, Any]:
    """values.yaml deep-merged with a CI file (enough for the keys these tests read)."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = (
                merge(out[key], value)
                if isinstance(value, dict) and isinstance(out.get(key), dict)
                else value
            )
        return out

    base = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    return merge(base, yaml.safe_load(values_file.read_text())) if values_file else base


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    values_file = VALUE_SETS[request.param]
    docs = render([values_file] if values_file else [])
    return docs, _effective_values(values_file)


def test_ci_values_files_present() -> None:
    assert set(VALUE_SETS) >= EXPECTED_CI_FILES


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(name: str) -> None:
    values_file = VALUE_SETS[name]
    args = ["--values", str(values_file)] if values_file else []
    result = run_helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART_DIR), *args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_matches_its_kubernetes_schema(rendered) -> None:
    docs, _ = rendered
    assert docs
    for doc in docs:
        validate_manifest(doc)  # raises on a schema violation or an unknown kind


def test_validator_rejects_unknown_kinds_and_fields(rendered) -> None:
    docs, _ = rendered
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_manifest({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    broken = copy.deepcopy(deployment_for(docs, "target"))
    container(broken)["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(broken)


def test_probes_use_grpc_health_on_a_plaintext_port(rendered) -> None:
    docs, values = rendered
    for role in ROLES:
        c = container(deployment_for(docs, role))
        grpc_port = {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
        assert grpc_port == values[role]["settings"]["port"]
        # Kubelet gRPC probes cannot speak TLS: with TLS (the default) they use the health-only port.
        probe_port = values["tls"]["healthPort"] if values["tls"]["enabled"] else grpc_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == probe_port, (role, probe)
        # readiness/startup wait for the role's own service (model loaded); liveness asks the server.
        assert c["startupProbe"]["grpc"]["service"] == GRPC_SERVICE[role]
        assert c["readinessProbe"]["grpc"]["service"] == GRPC_SERVICE[role]
        assert c["livenessProbe"]["grpc"].get("service", "") == ""


def test_hpas_target_their_deployments_and_replicas_are_left_to_them(rendered) -> None:
    docs, values = rendered
    deployments = by_kind(docs, "Deployment")
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    for role in ROLES:
        deployment = deployment_for(docs, role)
        scaled = [
            h for h in hpas.values() if h["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        ]
        if values[role]["autoscaling"]["enabled"]:
            (hpa,) = scaled
            assert hpa["apiVersion"] == "autoscaling/v2"
            assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
            assert hpa["spec"]["scaleTargetRef"]["apiVersion"] == "apps/v1"
            assert hpa["spec"]["metrics"]
            assert "replicas" not in deployment["spec"], role
        else:
            assert not scaled
            assert deployment["spec"]["replicas"] == values[role]["replicaCount"]
    for hpa in hpas.values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def test_selectors_match_pod_labels_and_only_their_own_pods(rendered) -> None:
    docs, _ = rendered
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for workload in workloads:
        assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload))
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"):
            assert key in pod_labels(workload)
    for kind in ("Service", "PodDisruptionBudget"):
        for name, doc in by_kind(docs, kind).items():
            selector = doc["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            chosen = [w for w in workloads if selects(selector, pod_labels(w))]
            assert [component(w) for w in chosen] == [component(doc)], (kind, name)


def test_services_for_gpu_roles_are_headless_and_expose_the_grpc_port(rendered) -> None:
    docs, values = rendered
    services = {component(s): s for s in by_kind(docs, "Service").values()}
    for role in ROLES:
        spec = services[role]["spec"]
        ports = {p["name"]: p for p in spec["ports"]}
        assert ports["grpc"]["port"] == values[role]["settings"]["port"]
        assert ports["grpc"]["targetPort"] == "grpc"
        if role in GPU_ROLES:
            assert spec["clusterIP"] == "None"  # one A record per ready pod: the router's replica list
            assert spec.get("publishNotReadyAddresses", False) is False
        else:
            assert spec.get("clusterIP") != "None"


def test_gpu_limits_only_where_configured(rendered) -> None:
    docs, values = rendered
    for role in ROLES:
        resources = container(deployment_for(docs, role)).get("resources", {})
        configured = values[role].get("gpu", {}).get("count", 0)
        gpu = resources.get("limits", {}).get("nvidia.com/gpu")
        assert gpu == (configured or None), role
        assert "nvidia.com/gpu" not in resources.get("requests", {})
        device = env_of(deployment_for(docs, role)).get("SPECSERVE_DEVICE")
        if role in GPU_ROLES and not values["engine"]["device"]:
            assert device == ("cuda" if configured else None)
    for _, pod in iter_pod_specs(docs):
        if pod.get("runtimeClassName"):
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1


def _service_by_fqdn(docs: list[dict[str, Any]], host: str) -> dict[str, Any]:
    suffix = f".{NAMESPACE}.svc.cluster.local"
    assert host.endswith(suffix), host
    return by_kind(docs, "Service")[host.removesuffix(suffix)]


def test_router_env_names_the_rendered_target_draft_and_redis_services(rendered) -> None:
    docs, values = rendered
    env = env_of(deployment_for(docs, "router"))
    for role, name in (
        ("target", "SPECSERVE_ROUTER_TARGET_ADDRESSES"),
        ("draft", "SPECSERVE_ROUTER_DRAFT_ADDRESSES"),
    ):
        (entry,) = env[name].split(",")
        assert entry.startswith("dns:///"), entry
        host, port = entry.removeprefix("dns:///").rsplit(":", 1)
        service = _service_by_fqdn(docs, host)
        assert component(service) == role
        assert service["spec"]["clusterIP"] == "None"
        assert int(port) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
        assert int(port) == values[role]["settings"]["port"]
    redis_url = env["SPECSERVE_ROUTER_REDIS_URL"]
    if values["redis"]["mode"] == "bundled":
        host_port = redis_url.removeprefix("redis://").split("/")[0].rsplit("@", 1)[-1]  # after a password
        host, port = host_port.rsplit(":", 1)
        service = _service_by_fqdn(docs, host)
        assert component(service) == "redis"
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
        (statefulset,) = by_kind(docs, "StatefulSet").values()
        assert selects(service["spec"]["selector"], pod_labels(statefulset))
    else:
        assert redis_url == values["redis"]["external"]["url"]
        assert not by_kind(docs, "StatefulSet")


def test_termination_grace_covers_the_drain(rendered) -> None:
    docs, _ = rendered
    for role in ROLES:
        deployment = deployment_for(docs, role)
        drain = float(env_of(deployment)[f"SPECSERVE_{role.upper()}_DRAIN_SECONDS"])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain, role
        assert grace >= math.ceil(drain) + 5, role  # room for the process to exit after the drain


def test_containers_have_unique_env_names_and_otel_per_role(rendered) -> None:
    docs, values = rendered
    for role in ROLES:
        names = [e["name"] for e in container(deployment_for(docs, role)).get("env", [])]
        assert len(names) == len(set(names)), role
        env = env_of(deployment_for(docs, role))
        assert env["OTEL_SERVICE_NAME"] == f"{values['otel']['serviceNamePrefix']}-{role}"
        endpoint = values["otel"]["endpoint"]
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == (endpoint or None)
        assert env["OTEL_TRACES_EXPORTER"] == (
            values["otel"]["tracesExporter"] or ("otlp" if endpoint else "none")
        )


def test_gpu_roles_mount_shm_cache_and_models(rendered) -> None:
    docs, values = rendered
    for role in GPU_ROLES:
        deployment = deployment_for(docs, role)
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["name"]: m["mountPath"] for m in container(deployment).get("volumeMounts", [])}
        if values[role]["shmSize"]:
            assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": values[role]["shmSize"]}
            assert mounts["shm"] == "/dev/shm"
        else:
            assert "shm" not in volumes
        assert mounts["cache"] == env_of(deployment)["SPECSERVE_CACHE_DIR"]
        source = values["models"]["source"]
        if source == "none":
            assert "models" not in volumes
        else:
            assert source in volumes["models"]
            for name in ("SPECSERVE_MODEL_DIR", "SPECSERVE_GLIDE_DIR"):
                path = env_of(deployment).get(name)
                if path:
                    assert path.startswith(mounts["models"] + "/"), (name, path)
    router_pod = deployment_for(docs, "router")["spec"]["template"]["spec"]
    assert {v["name"] for v in router_pod["volumes"]} <= {"tmp", "home", "tls", "auth"}  # no model volumes


def test_service_monitor_scrapes_every_role_metrics_port(rendered) -> None:
    docs, values = rendered
    monitors = by_kind(docs, "ServiceMonitor")
    if not values["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    services = by_kind(docs, "Service").values()
    assert sorted(component(m) for m in monitors.values()) == sorted(ROLES)
    for monitor in monitors.values():
        (scraped,) = [
            s
            for s in services
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert component(scraped) == component(monitor)
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in scraped["spec"]["ports"]}


def test_metrics_listen_on_every_interface_for_scraping_by_pod_ip(rendered) -> None:
    docs, _ = rendered
    for role in ROLES:
        prefix = f"SPECSERVE_{role.upper()}_"
        assert env_of(deployment_for(docs, role))[prefix + "METRICS_HOST"] == "0.0.0.0"


def monitors_by_role(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each role's ServiceMonitor endpoint."""
    return {component(m): m["spec"]["endpoints"][0] for m in by_kind(docs, "ServiceMonitor").values()}


def test_with_tls_prometheus_scrapes_https_with_a_client_certificate_from_the_tls_secret() -> None:
    docs = render(set_values=["serviceMonitor.enabled=true"])
    (secret,) = [
        s for s in by_kind(docs, "Secret").values() if s["metadata"]["name"] == f"{RELEASE}-specserve-tls"
    ]
    for role, endpoint in monitors_by_role(docs).items():
        assert endpoint["scheme"] == "https"
        config = endpoint["tlsConfig"]
        # Pods are scraped by IP: their certificates are checked against their Service's name.
        assert config["serverName"] == f"{RELEASE}-specserve-{role}.{NAMESPACE}.svc.cluster.local"
        references = [config["ca"]["secret"], config["cert"]["secret"], config["keySecret"]]
        assert {r["name"] for r in references} == {secret["metadata"]["name"]}
        # A certificate of its own: not a service's, which would let Prometheus call the services.
        assert [r["key"] for r in references] == ["ca.crt", "metrics.crt", "metrics.key"]
        assert all(r["key"] in secret["data"] for r in references)
    for service in by_kind(docs, "Service").values():
        if component(service) in ROLES:
            (port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
            assert port["appProtocol"] == "https"


@pytest.mark.parametrize("tls", [True, False])
def test_the_http_api_port_names_the_protocol_it_serves(tls: bool) -> None:
    docs = render(set_values=["router.settings.httpPort=8080", f"tls.enabled={str(tls).lower()}"])
    (router,) = [s for s in by_kind(docs, "Service").values() if component(s) == "router"]
    (api,) = [p for p in router["spec"]["ports"] if p["name"] == "http"]
    assert api["appProtocol"] == ("https" if tls else "http")  # HTTPS with the router's certificate


def test_with_your_own_certificates_prometheus_needs_a_secret_of_its_own() -> None:
    own = [f"tls.secrets.{role}={role}-tls" for role in ROLES] + ["serviceMonitor.enabled=true"]
    refused = render_result(set_values=own)
    assert refused.returncode != 0
    assert "serviceMonitor.tlsSecret" in refused.stderr
    docs = render(set_values=[*own, "serviceMonitor.tlsSecret=prometheus-client-tls"])
    for monitor in by_kind(docs, "ServiceMonitor").values():
        validate_manifest(monitor)
    for endpoint in monitors_by_role(docs).values():
        config = endpoint["tlsConfig"]
        assert (config["ca"]["secret"], config["cert"]["secret"], config["keySecret"]) == (
            {"name": "prometheus-client-tls", "key": "ca.crt"},
            {"name": "prometheus-client-tls", "key": "tls.crt"},
            {"name": "prometheus-client-tls", "key": "tls.key"},
        )


def test_without_tls_prometheus_scrapes_plain_http() -> None:
    docs = render(set_values=["serviceMonitor.enabled=true", "tls.enabled=false"])
    for endpoint in monitors_by_role(docs).values():
        assert endpoint["scheme"] == "http"
        assert "tlsConfig" not in endpoint


def test_external_redis_url_from_a_secret() -> None:
    docs = render(
        [CI_DIR / "external-redis-values.yaml"],
        ["redis.external.url=", "redis.external.existingSecret.name=sessions-redis"],
    )
    value_from = env_of(deployment_for(docs, "router"))["SPECSERVE_ROUTER_REDIS_URL"]
    assert value_from == {"secretKeyRef": {"name": "sessions-redis", "key": "url"}}
