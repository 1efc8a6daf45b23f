"""The chart's defaults require a bearer token at the router: without `auth.existingSecret` it generates
the token Secret itself (one random token, kept across upgrades), so a default install is never an open
API. TLS stays opt-in (it needs a certificate Secret per role, docs/security.md), and NOTES.txt says so."""

from __future__ import annotations

import base64

from chart_support import CHART_DIR, by_kind, container, deployment_for, env_of, render, run_helm

from specserve.serving.settings import RouterServiceSettings


def secrets_named(docs: list[dict], name: str) -> list[dict]:
    return [s for s in by_kind(docs, "Secret").values() if s["metadata"]["name"] == name]


def generated_tokens(docs: list[dict]) -> list[str]:
    (secret,) = secrets_named(docs, "rel-specserve-auth")
    return base64.b64decode(secret["data"]["tokens"]).decode().split()


def test_the_default_router_requires_a_token_from_a_generated_secret() -> None:
    docs = render()
    deployment = deployment_for(docs, "router")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "rel-specserve-auth"
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    env = {k: v for k, v in env_of(deployment).items() if isinstance(v, str)}
    assert RouterServiceSettings.from_env(env).auth_token_file == f"{mounts['auth']['mountPath']}/tokens"
    (secret,) = secrets_named(docs, "rel-specserve-auth")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # kept on uninstall
    tokens = generated_tokens(docs)
    assert len(tokens) == 1 and len(tokens[0]) >= 32
    assert generated_tokens(render()) != tokens  # random per install (an upgrade keeps the cluster's)


def test_your_own_secret_or_auth_off_generates_none() -> None:
    own = render(set_values=["auth.existingSecret=api-tokens"])
    assert secrets_named(own, "rel-specserve-auth") == []
    assert secrets_named(render(set_values=["auth.enabled=false"]), "rel-specserve-auth") == []


def test_the_notes_say_where_the_token_is_and_warn_of_plaintext() -> None:
    done = run_helm("install", "rel", str(CHART_DIR), "--namespace", "ns", "--dry-run=client")
    assert done.returncode == 0, done.stderr
    assert "get secret rel-specserve-auth -o jsonpath='{.data.tokens}'" in done.stdout
    assert "WARNING: tls.enabled is false" in done.stdout
