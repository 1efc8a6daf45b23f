"""The chart's hardening, rendered offline with the real helm binary: NetworkPolicies (router <- clients;
target <- router and draft; draft <- router; Redis <- router), read-only root filesystems with writable
emptyDirs, seccomp RuntimeDefault, the bundled Redis's password and append-only persistence, and your
own TLS Secrets and the token Secret wired into the services' settings (read back through the services'
own parsers). The certificates the chart generates are in test_chart_secure_defaults.py."""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import (
    ROLES,
    by_kind,
    component,
    container,
    deployment_for,
    env_of,
    pod_labels,
    render,
    selects,
    validate_manifest,
)

from specserve.serving.settings import DraftServiceSettings, RouterServiceSettings, TargetServiceSettings

SETTINGS = {"target": TargetServiceSettings, "draft": DraftServiceSettings, "router": RouterServiceSettings}
OWN_TLS_SECRETS = {"router": "router-cert", "target": "target-cert", "draft": "draft-cert"}
SECURE = {
    "tls": {"enabled": True, "secrets": OWN_TLS_SECRETS},
    "auth": {"enabled": True, "existingSecret": "api-tokens"},
    "router": {"settings": {"httpPort": 8080}},
}


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def secure_docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(values=SECURE, tmp_dir=tmp_path_factory.mktemp("secure"))


def policy_for(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (policy,) = [p for p in by_kind(docs, "NetworkPolicy").values() if component(p) == role]
    return policy


def allowed_sources(docs: list[dict[str, Any]], role: str, port: int) -> set[str] | None:
    """Components whose pods may reach `port` of `role`'s pods; None = from anywhere."""
    policy = policy_for(docs, role)
    sources: set[str] = set()
    for rule in policy["spec"]["ingress"]:
        if port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return None
        for peer in rule["from"]:
            sources.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
    return sources


def test_network_policies_allow_only_the_documented_paths(default_docs) -> None:
    assert allowed_sources(default_docs, "router", 50050) is None  # the public API
    assert allowed_sources(default_docs, "target", 50051) == {"router", "draft"}
    assert allowed_sources(default_docs, "draft", 50052) == {"router"}
    assert allowed_sources(default_docs, "redis", 6379) == {"router"}
    for role in (*ROLES, "redis"):
        policy = policy_for(default_docs, role)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        pods = [
            d
            for d in [
                *by_kind(default_docs, "Deployment").values(),
                *by_kind(default_docs, "StatefulSet").values(),
            ]
            if component(d) == role
        ]
        assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(pods[0]))


def test_network_policies_can_be_turned_off(tmp_path) -> None:
    docs = render(values={"networkPolicy": {"enabled": False}}, tmp_dir=tmp_path)
    assert not by_kind(docs, "NetworkPolicy")


def test_every_container_has_a_read_only_root_and_runtime_default_seccomp(default_docs) -> None:
    workloads = [
        *by_kind(default_docs, "Deployment").values(),
        *by_kind(default_docs, "StatefulSet").values(),
    ]
    assert len(workloads) == 4
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            # Whatever is writable is an emptyDir (or Redis's data volume).
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for mount in c.get("volumeMounts", []):
                if mount.get("readOnly"):
                    continue
                assert mount["name"] == "data" or "emptyDir" in volumes[mount["name"]], mount
    for role in ROLES:
        mounts = {m["mountPath"] for m in container(deployment_for(default_docs, role))["volumeMounts"]}
        assert {"/tmp", "/home/specserve"} <= mounts


def test_bundled_redis_has_a_password_and_append_only_persistence(default_docs) -> None:
    (redis,) = by_kind(default_docs, "StatefulSet").values()
    (redis_container,) = redis["spec"]["template"]["spec"]["containers"]
    args = redis_container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_env = {e["name"]: e for e in redis_container["env"]}
    secret_ref = redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert redis_env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == secret_ref  # the probe's redis-cli
    (secret,) = [
        s for s in by_kind(default_docs, "Secret").values() if s["metadata"]["name"] == secret_ref["name"]
    ]
    assert len(secret["data"][secret_ref["key"]]) >= 40  # base64 of a 32-character random password
    # The router reads the same Secret, defined before the URL that expands it.
    router_env = container(deployment_for(default_docs, "router"))["env"]
    names = [e["name"] for e in router_env]
    assert names.index("REDIS_PASSWORD") < names.index("SPECSERVE_ROUTER_REDIS_URL")
    assert router_env[names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"] == secret_ref
    assert router_env[names.index("SPECSERVE_ROUTER_REDIS_URL")]["value"].startswith(
        "redis://:$(REDIS_PASSWORD)@"
    )


def test_tls_secrets_are_mounted_and_named_in_the_settings(secure_docs) -> None:
    # Your own Secrets: each role's mounted whole, and the chart generates none.
    assert "rel-specserve-tls" not in by_kind(secure_docs, "Secret")
    for role in ROLES:
        deployment = deployment_for(secure_docs, role)
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == OWN_TLS_SECRETS[role]
        assert "items" not in volumes["tls"]["secret"]
        mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
        assert mounts["tls"]["readOnly"] is True
        env = {k: v for k, v in env_of(deployment).items() if isinstance(v, str)}
        settings = SETTINGS[role].from_env(env)
        directory = mounts["tls"]["mountPath"]
        assert (settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file) == (
            f"{directory}/tls.crt",
            f"{directory}/tls.key",
            f"{directory}/ca.crt",
        )
        # Replicas are dialled by pod IP: certificates are checked against the Services' names.
        if role != "target":
            assert settings.tls_target_name == "rel-specserve-target.specserve-test.svc.cluster.local"
        if role == "router":
            assert settings.tls_draft_name == "rel-specserve-draft.specserve-test.svc.cluster.local"
        # Kubelet probes cannot speak TLS: they use the plaintext health-only port.
        assert settings.health_port == 8086
        for probe in ("startupProbe", "readinessProbe"):
            assert container(deployment)[probe]["grpc"]["port"] == 8086
        assert 8086 in {
            p["port"] for rule in policy_for(secure_docs, role)["spec"]["ingress"] for p in rule["ports"]
        }


def test_the_token_secret_is_mounted_as_the_routers_token_file(secure_docs) -> None:
    deployment = deployment_for(secure_docs, "router")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "api-tokens"
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    env = {k: v for k, v in env_of(deployment).items() if isinstance(v, str)}
    settings = RouterServiceSettings.from_env(env)
    assert settings.auth_token_file == f"{mounts['auth']['mountPath']}/tokens"
    assert "SPECSERVE_ROUTER_AUTH_TOKENS" not in env  # tokens never sit in the pod spec
    for role in ("target", "draft"):
        assert "auth" not in {
            v["name"] for v in deployment_for(secure_docs, role)["spec"]["template"]["spec"]["volumes"]
        }
    # The HTTP API port is the router's too: open to clients like the gRPC one.
    assert allowed_sources(secure_docs, "router", 8080) is None


def test_the_draft_dials_only_the_targets_the_router_names(default_docs) -> None:
    router = env_of(deployment_for(default_docs, "router"))
    draft = env_of(deployment_for(default_docs, "draft"))
    assert draft["SPECSERVE_DRAFT_TARGET_ADDRESSES"] == router["SPECSERVE_ROUTER_TARGET_ADDRESSES"]


def test_the_secure_render_is_valid_kubernetes(secure_docs) -> None:
    kinds = {doc["kind"] for doc in secure_docs}
    assert {"NetworkPolicy", "Secret", "Deployment", "StatefulSet"} <= kinds
    for doc in secure_docs:
        validate_manifest(doc)  # strict: unknown fields fail too
