"""The chart's defaults are TLS and tokens, with nothing for the user to bring.

Tokens: without `auth.existingSecret` the chart generates the token Secret (one random token, kept across
upgrades), so a default install is never an open API. TLS: without `tls.secrets` the chart generates a CA
and a certificate per role (Helm's genCA / genSignedCert) into one Secret, and each pod mounts its own
role's files. The generated certificates are checked the way the services will use them: the rendered
env read back through the settings objects, the Secret's files where the pods' volumes put them,
mutual TLS between real gRPC servers and channels built by specserve's own TLS code, and the metrics
ports scraped as the ServiceMonitors tell Prometheus to (with the chart's metrics client certificate).
`tls.enabled: false` is the insecure opt-out, and NOTES.txt says so.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import socket
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

import grpc
import pytest
from chart_support import CHART_DIR, ROLES, by_kind, container, deployment_for, env_of, render, run_helm
from cryptography import x509
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry, Counter

from specserve.serving import tls
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import (
    DraftServiceSettings,
    RouterServiceSettings,
    ServerSettings,
    TargetServiceSettings,
)
from specserve.serving.stack import free_port
from specserve.v1 import draft_pb2, draft_pb2_grpc, router_pb2, router_pb2_grpc, target_pb2, target_pb2_grpc

SETTINGS: dict[str, type[ServerSettings]] = {
    "target": TargetServiceSettings,
    "draft": DraftServiceSettings,
    "router": RouterServiceSettings,
}
COMMON_NAMES = {"router": tls.ROUTER_NAME, "target": tls.TARGET_NAME, "draft": tls.DRAFT_NAME}
TLS_SECRET = "rel-specserve-tls"
FQDN = "rel-specserve-{role}.specserve-test.svc.cluster.local"


def secrets_named(docs: list[dict], name: str) -> list[dict]:
    return [s for s in by_kind(docs, "Secret").values() if s["metadata"]["name"] == name]


def generated_tokens(docs: list[dict]) -> list[str]:
    (secret,) = secrets_named(docs, "rel-specserve-auth")
    return base64.b64decode(secret["data"]["tokens"]).decode().split()


def string_env(deployment: dict) -> dict[str, str]:
    return {k: v for k, v in env_of(deployment).items() if isinstance(v, str)}


def tls_volume(deployment: dict) -> dict[str, Any]:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return volumes["tls"]["secret"]


def mount_path(deployment: dict, volume: str) -> str:
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    return mounts[volume]["mountPath"]


def certificate(secret: dict, key: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render()


# -- tokens -------------------------------------------------------------------------------------------


def test_the_default_router_requires_a_token_from_a_generated_secret(default_docs) -> None:
    deployment = deployment_for(default_docs, "router")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "rel-specserve-auth"
    settings = RouterServiceSettings.from_env(string_env(deployment))
    assert settings.auth_token_file == f"{mount_path(deployment, 'auth')}/tokens"
    (secret,) = secrets_named(default_docs, "rel-specserve-auth")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # kept on uninstall
    tokens = generated_tokens(default_docs)
    assert len(tokens) == 1 and len(tokens[0]) >= 32
    assert generated_tokens(render()) != tokens  # random per install (an upgrade keeps the cluster's)


def test_your_own_secret_or_auth_off_generates_none() -> None:
    own = render(set_values=["auth.existingSecret=api-tokens"])
    assert secrets_named(own, "rel-specserve-auth") == []
    assert secrets_named(render(set_values=["auth.enabled=false"]), "rel-specserve-auth") == []


# -- TLS: what is rendered ----------------------------------------------------------------------------


def test_the_default_render_generates_tls_and_wires_it_into_every_service(default_docs) -> None:
    (secret,) = secrets_named(default_docs, TLS_SECRET)
    assert set(secret["data"]) == {"ca.crt", "ca.key", "metrics.crt", "metrics.key"} | {
        f"{r}.{ext}" for r in ROLES for ext in ("crt", "key")
    }
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for role in ROLES:
        deployment = deployment_for(default_docs, role)
        volume = tls_volume(deployment)
        assert volume["secretName"] == TLS_SECRET
        # Only the role's own certificate and key, and the CA's certificate: never the CA's key.
        assert {item["key"]: item["path"] for item in volume["items"]} == {
            "ca.crt": "ca.crt",
            f"{role}.crt": "tls.crt",
            f"{role}.key": "tls.key",
        }
        directory = mount_path(deployment, "tls")
        settings = SETTINGS[role].from_env(string_env(deployment))
        assert (settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file) == (
            f"{directory}/tls.crt",
            f"{directory}/tls.key",
            f"{directory}/ca.crt",
        )
        # Target and draft ask callers for a certificate (mutual TLS); the router's clients use tokens.
        assert settings.tls_client_auth is (role != "router")
        assert settings.health_port == 8086  # the kubelet's probes: plaintext health only
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["checksum/tls-names"] == secret["metadata"]["annotations"]["checksum/tls-names"]


def test_generated_certificates_carry_the_names_the_services_check(default_docs) -> None:
    (secret,) = secrets_named(default_docs, TLS_SECRET)
    ca = certificate(secret, "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    settings = {r: SETTINGS[r].from_env(string_env(deployment_for(default_docs, r))) for r in ROLES}
    for role in ROLES:
        cert = certificate(secret, f"{role}.crt")
        cert.verify_directly_issued_by(ca)
        (name,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        assert name.value == COMMON_NAMES[role]
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert FQDN.format(role=role) in names.get_values_for_type(x509.DNSName)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
        assert cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3000)
    # Who may call whom is decided by these common names, under the services' default settings.
    assert tls.ROUTER_NAME in settings["target"].tls_allowed_clients
    assert tls.DRAFT_NAME in settings["target"].tls_kv_feed_clients
    assert tls.ROUTER_NAME in settings["draft"].tls_allowed_clients
    # The router and draft verify replicas (dialled by pod IP) against their Services' names.
    assert (
        settings["router"].tls_target_name == settings["draft"].tls_target_name == FQDN.format(role="target")
    )
    assert settings["router"].tls_draft_name == FQDN.format(role="draft")
    router_names = certificate(secret, "router.crt").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert "localhost" in router_names.value.get_values_for_type(x509.DNSName)  # kubectl port-forward


def test_each_install_gets_its_own_ca() -> None:
    first, second = (secrets_named(render(), TLS_SECRET)[0]["data"]["ca.crt"] for _ in range(2))
    assert first != second  # `helm template` cannot look up the cluster's: an upgrade keeps that one


def test_extra_router_names_and_new_names_are_recorded(tmp_path: Path) -> None:
    docs = render(values={"tls": {"generated": {"routerDnsNames": ["api.example.com"]}}}, tmp_dir=tmp_path)
    (secret,) = secrets_named(docs, TLS_SECRET)
    names = certificate(secret, "router.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "api.example.com" in names.value.get_values_for_type(x509.DNSName)
    (default,) = secrets_named(render(), TLS_SECRET)
    # Other names, another fingerprint: an upgrade re-issues the certificates and the pods restart.
    key = "checksum/tls-names"
    assert secret["metadata"]["annotations"][key] != default["metadata"]["annotations"][key]


def test_tls_off_is_plaintext_and_generates_nothing(tmp_path: Path) -> None:
    docs = render(set_values=["tls.enabled=false"], tmp_dir=tmp_path)
    assert secrets_named(docs, TLS_SECRET) == []
    for role in ROLES:
        deployment = deployment_for(docs, role)
        assert "tls" not in {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert not tls.tls_enabled(SETTINGS[role].from_env(string_env(deployment)))


def test_the_notes_say_where_the_token_and_the_ca_are_and_warn_of_plaintext() -> None:
    done = run_helm("install", "rel", str(CHART_DIR), "--namespace", "ns", "--dry-run=client")
    assert done.returncode == 0, done.stderr
    assert "get secret rel-specserve-auth -o jsonpath='{.data.tokens}'" in done.stdout
    assert "get secret rel-specserve-tls -o jsonpath='{.data.ca\\.crt}'" in done.stdout
    assert "WARNING" not in done.stdout
    off = run_helm(
        "install",
        "rel",
        str(CHART_DIR),
        "--namespace",
        "ns",
        "--dry-run=client",
        "--set",
        "tls.enabled=false",
    )
    assert off.returncode == 0, off.stderr
    assert "WARNING: tls.enabled is false (INSECURE)" in off.stdout


# -- TLS: the generated certificates at work ----------------------------------------------------------


def mounted_settings(docs: list[dict], role: str, root: Path) -> ServerSettings:
    """The role's settings as its pod reads them, with the Secret's files where its volume puts them
    (under `root` instead of the mount path), serving on a free loopback port."""
    deployment = deployment_for(docs, role)
    (secret,) = secrets_named(docs, tls_volume(deployment)["secretName"])
    directory = root / role
    directory.mkdir()
    for item in tls_volume(deployment)["items"]:
        (directory / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
    mounted = mount_path(deployment, "tls")
    env = {k: v.replace(mounted, str(directory)) for k, v in string_env(deployment).items()}
    return SETTINGS[role].from_env(env, host="127.0.0.1", port=0, health_port=0, metrics_port=0)


def serve(settings: ServerSettings, role: str, registry: CollectorRegistry | None = None) -> RunningServer:
    """A real server with the role's security (TLS, peer names); its API answers UNIMPLEMENTED (no model),
    so any other status comes from the security layer. With a registry, it serves /metrics too."""
    add = {
        "target": lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(
            target_pb2_grpc.TargetServiceServicer(), s
        ),
        "draft": lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(
            draft_pb2_grpc.DraftServiceServicer(), s
        ),
        "router": lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(
            router_pb2_grpc.RouterServiceServicer(), s
        ),
    }[role]
    return start_server(settings, add, (), registry=registry)


def status_of(call: Any, request: Any) -> grpc.StatusCode:
    try:
        response = call(request, timeout=10)
        if not hasattr(response, "ByteSize"):  # a server stream
            list(response)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_generated_certificates_give_mutual_tls_between_the_services(default_docs, tmp_path: Path) -> None:
    settings = {role: mounted_settings(default_docs, role, tmp_path) for role in ROLES}
    servers = {role: serve(settings[role], role) for role in ROLES}
    try:
        target_address = f"127.0.0.1:{servers['target'].port}"
        draft_address = f"127.0.0.1:{servers['draft'].port}"

        def dial(caller: str, address: str, server_name: str) -> grpc.Channel:
            return tls.open_channel(address, settings[caller], [], server_name)

        router, draft = settings["router"], settings["draft"]
        assert isinstance(router, RouterServiceSettings) and isinstance(draft, DraftServiceSettings)
        # The router calls the target and the draft as it does in the cluster (by address, verified
        # against their Services' names); UNIMPLEMENTED means TLS and the peer check let it through.
        with dial("router", target_address, router.tls_target_name) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            assert (
                status_of(stub.GetModelInfo, target_pb2.GetModelInfoRequest())
                == grpc.StatusCode.UNIMPLEMENTED
            )
            assert status_of(stub.StreamKV, target_pb2.StreamKVRequest()) == grpc.StatusCode.PERMISSION_DENIED
        with dial("router", draft_address, router.tls_draft_name) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            assert status_of(stub.Release, draft_pb2.DraftReleaseRequest()) == grpc.StatusCode.UNIMPLEMENTED
        # The draft reads the target's KV feed and its model info (the costs it sizes trees by), and
        # nothing else of it.
        with dial("draft", target_address, draft.tls_target_name) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            assert status_of(stub.StreamKV, target_pb2.StreamKVRequest()) == grpc.StatusCode.UNIMPLEMENTED
            assert status_of(stub.GetModelInfo, target_pb2.GetModelInfoRequest()) == (
                grpc.StatusCode.UNIMPLEMENTED
            )
            assert status_of(stub.Release, target_pb2.ReleaseRequest()) == grpc.StatusCode.PERMISSION_DENIED
        # Without a certificate, or in plaintext, the target answers nobody.
        ca = Path(router.tls_ca_file).read_bytes()
        with grpc.secure_channel(
            target_address,
            grpc.ssl_channel_credentials(ca),
            options=tls.server_name_options(router.tls_target_name),
        ) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            assert (
                status_of(stub.GetModelInfo, target_pb2.GetModelInfoRequest()) == grpc.StatusCode.UNAVAILABLE
            )
        with grpc.insecure_channel(target_address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            assert (
                status_of(stub.GetModelInfo, target_pb2.GetModelInfoRequest()) == grpc.StatusCode.UNAVAILABLE
            )
        # A client verifies the router with the CA alone, through a port-forward (localhost).
        with grpc.secure_channel(
            f"localhost:{servers['router'].port}", grpc.ssl_channel_credentials(ca)
        ) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            # through TLS to the token check (the token Secret is not mounted here)
            assert (
                status_of(stub.ListMethods, router_pb2.ListMethodsRequest())
                == grpc.StatusCode.UNAUTHENTICATED
            )
    finally:
        for server in servers.values():
            server.stop(0)


def test_prometheus_scrapes_every_role_with_what_its_service_monitor_names(tmp_path: Path) -> None:
    """Each role's metrics, served with the role's mounted certificate, read the way the ServiceMonitor
    tells Prometheus to: HTTPS to the pod's address, the certificate checked against serverName, the
    chart's metrics certificate presented. Without that certificate nothing is served."""
    docs = render(set_values=["serviceMonitor.enabled=true"])
    (secret,) = secrets_named(docs, TLS_SECRET)
    monitors = {
        m["metadata"]["labels"]["app.kubernetes.io/component"]: m
        for m in by_kind(docs, "ServiceMonitor").values()
    }
    for role in ROLES:
        settings = dataclasses.replace(
            mounted_settings(docs, role, tmp_path), metrics_port=free_port(), metrics_host="127.0.0.1"
        )
        (endpoint,) = monitors[role]["spec"]["endpoints"]
        config = endpoint["tlsConfig"]
        scraper = tmp_path / f"{role}-scraper"
        scraper.mkdir()
        for name, reference in (
            ("ca", config["ca"]["secret"]),
            ("cert", config["cert"]["secret"]),
            ("key", config["keySecret"]),
        ):
            assert reference["name"] == TLS_SECRET
            (scraper / name).write_bytes(base64.b64decode(secret["data"][reference["key"]]))
        context = ssl.create_default_context(cafile=str(scraper / "ca"))
        anonymous = ssl.create_default_context(cafile=str(scraper / "ca"))
        context.load_cert_chain(scraper / "cert", scraper / "key")
        registry = CollectorRegistry()
        Counter("scraped", "A sample to find in the scrape", ["role"], registry=registry).labels(role).inc()
        server = serve(settings, role, registry)
        try:
            url = f"{endpoint['scheme']}://127.0.0.1:{settings.metrics_port}{endpoint['path']}"
            assert f'scraped_total{{role="{role}"}} 1.0' in scrape(url, context, config["serverName"])
            with pytest.raises(OSError) as refused:
                scrape(url, anonymous, config["serverName"])
            assert not isinstance(refused.value, ssl.SSLCertVerificationError)  # the server refused
        finally:
            server.stop(0)


def scrape(url: str, context: ssl.SSLContext, server_name: str) -> str:
    """GET `url` over TLS, verifying the server's certificate against `server_name` (not the URL's host)."""
    parsed = urllib.parse.urlsplit(url)
    assert parsed.hostname is not None and parsed.port is not None
    with (
        socket.create_connection((parsed.hostname, parsed.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as connection,
    ):
        connection.sendall(f"GET {parsed.path} HTTP/1.0\r\nHost: {server_name}\r\n\r\n".encode())
        response = b""
        while chunk := connection.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    return body.decode()
