"""The router's HTTP API in the chart: off unless `router.settings.httpPort` is set; then a named `http`
port on the router's container and Service, and a liveness probe on /health (startup and readiness stay
on grpc.health.v1, which reports SERVING only once the HTTP API is up too)."""

from __future__ import annotations

from chart_support import by_kind, component, container, deployment_for, env_of, render, validate_manifest


def router_service(docs: list[dict]) -> dict:
    [service] = [s for s in by_kind(docs, "Service").values() if component(s) == "router"]
    return service


def test_off_by_default(tmp_path) -> None:
    docs = render(tmp_dir=tmp_path)
    router = container(deployment_for(docs, "router"))
    assert "http" not in {p["name"] for p in router["ports"]}
    assert "SPECSERVE_ROUTER_HTTP_PORT" not in env_of(deployment_for(docs, "router"))
    assert "grpc" in router["livenessProbe"]
    assert "http" not in {p["name"] for p in router_service(docs)["spec"]["ports"]}


def test_a_port_adds_the_named_port_and_health_probe(tmp_path) -> None:
    docs = render(set_values=["router.settings.httpPort=8080"], tmp_dir=tmp_path)
    for doc in docs:
        validate_manifest(doc)
    deployment = deployment_for(docs, "router")
    router = container(deployment)
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in router["ports"]
    assert env_of(deployment)["SPECSERVE_ROUTER_HTTP_PORT"] == "8080"
    # TLS is on by default, and the HTTP API then serves HTTPS with the router's certificate.
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert router["readinessProbe"]["grpc"]["service"] == "specserve.v1.RouterService"
    ports = {p["name"]: p for p in router_service(docs)["spec"]["ports"]}
    assert ports["http"]["port"] == 8080 and ports["http"]["targetPort"] == "http"
    for role in ("target", "draft"):  # only the router serves HTTP
        assert "http" not in {p["name"] for p in container(deployment_for(docs, role))["ports"]}


def test_without_tls_the_health_probe_speaks_plain_http(tmp_path) -> None:
    docs = render(set_values=["router.settings.httpPort=8080", "tls.enabled=false"], tmp_dir=tmp_path)
    router = container(deployment_for(docs, "router"))
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
