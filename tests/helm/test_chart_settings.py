"""The chart's `settings` / `engine` values map one to one onto the services' settings dataclasses.

Renaming, adding or removing a settings field without the chart following fails here: the values keys
are compared with the dataclass fields, and a render with every key set is read back through the
services' own `from_env` parsers.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import CHART_DIR, container, deployment_for, env_of, render

from specserve.models.profiles import PROFILES
from specserve.serving.settings import (
    DraftServiceSettings,
    RouterServiceSettings,
    ServerSettings,
    TargetServiceSettings,
)
from specserve.settings import EngineSettings

ROLE_SETTINGS: dict[str, type[ServerSettings]] = {
    "target": TargetServiceSettings,
    "draft": DraftServiceSettings,
    "router": RouterServiceSettings,
}
# Settings the chart sets from another values block, not from `<role>.settings`.
SET_ELSEWHERE = {"router": {"redis_url": "redis.*"}}
# Chart defaults that deliberately differ from the Python default (with the reason).
CHART_OWN_DEFAULTS = {
    ("engine", "cache_dir"): "a writable emptyDir is mounted there",
    **{(role, "metrics_host"): "Prometheus scrapes pods by IP" for role in ("target", "draft", "router")},
}
EXTERNAL_REDIS_URL = "redis://sessions.example.com:6390/3"
# Settings the chart fills in from `tls` while they are null (test_chart_secure_defaults.py checks them).
TLS_DERIVED = {
    "tls_cert_file",
    "tls_key_file",
    "tls_ca_file",
    "health_port",
    "tls_target_name",
    "tls_draft_name",
}

VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_values_keys_are_the_settings_fields(role: str) -> None:
    fields = set(_field_names(ROLE_SETTINGS[role])) - set(SET_ELSEWHERE.get(role, {}))
    assert set(VALUES[role]["settings"]) == {camel(f) for f in fields}


def test_engine_values_keys_are_the_engine_settings_fields() -> None:
    assert set(VALUES["engine"]) == {camel(f) for f in _field_names(EngineSettings)}


def test_non_null_chart_defaults_equal_the_python_defaults() -> None:
    blocks = {role: (cls(), VALUES[role]["settings"]) for role, cls in ROLE_SETTINGS.items()}
    blocks["engine"] = (EngineSettings(), VALUES["engine"])
    for block, (defaults, values) in blocks.items():
        for f in dataclasses.fields(defaults):
            value = values.get(camel(f.name))
            if value is None or (block, f.name) in CHART_OWN_DEFAULTS:
                continue
            assert value == getattr(defaults, f.name), f"{block}.{camel(f.name)}"


def _non_default(cls: type, name: str, default: Any) -> Any:
    """A value unlike the default, of the field's type, that the settings still accept."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args and typing.get_origin(hint) is not tuple else hint
    if typing.get_origin(hint) is tuple:
        return ["a.example:5001", "dns:///b.example:5002"]
    if base is bool:
        return not default
    if base is int:
        return (default or 0) + 16_777_217  # large: catches 1.6e+07-style rendering
    if base is float:
        return (default or 0) + 2.5
    if base is Path or "Path" in str(hint):
        return f"/data/{name}"
    return f"{name}-value"


SPECIAL = {
    "host": "0.0.0.0",
    "port": 40001,
    "metrics_port": 40002,
    "health_port": 40003,
    "http_port": 40003,
    "dtype": "bfloat16",
    "draft_dtype": "float16",
    "model": "qwen2.5-coder-1.5b-instruct",
    "linear_kernel": "native",
    "weights": "as-shipped",
    "int4_kernel": "torch",
    "draft_weights": "int8",
    "device": "cuda:1",
    "max_context": 8192,
    "max_prompt_tokens": 4096,
    "max_ahead_rounds": 3,
}


def _all_set(cls: type) -> dict[str, Any]:
    instance = cls()
    return {
        f.name: SPECIAL.get(f.name, _non_default(cls, f.name, getattr(instance, f.name)))
        for f in dataclasses.fields(cls)
    }


def _expected(cls: type, chosen: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    converted = {}
    for name, value in chosen.items():
        if typing.get_origin(hints[name]) is tuple:
            value = tuple(value)
        elif "Path" in str(hints[name]):
            value = Path(value)
        converted[name] = value
    return dataclasses.replace(cls(), **converted)


@pytest.fixture(scope="module")
def everything_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    chosen: dict[str, dict[str, Any]] = {role: _all_set(cls) for role, cls in ROLE_SETTINGS.items()}
    chosen["router"].pop("redis_url")
    chosen["engine"] = _all_set(EngineSettings)
    values: dict[str, Any] = {
        role: {"settings": {camel(k): v for k, v in chosen[role].items()}} for role in ROLE_SETTINGS
    }
    values["engine"] = {camel(k): v for k, v in chosen["engine"].items()}
    values["redis"] = {"mode": "external", "external": {"url": EXTERNAL_REDIS_URL}}
    docs = render(values=values, tmp_dir=tmp_path_factory.mktemp("all-settings"))
    chosen["router"]["redis_url"] = EXTERNAL_REDIS_URL
    return docs, chosen


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_every_setting_renders_to_the_env_name_the_service_reads(everything_set, role: str) -> None:
    docs, _ = everything_set
    cls = ROLE_SETTINGS[role]
    names = {
        e["name"] for e in container(deployment_for(docs, role))["env"] if e["name"].startswith("SPECSERVE_")
    }
    expected = {cls.ENV_PREFIX + f.upper() for f in _field_names(cls)}
    if role != "router":
        expected |= {"SPECSERVE_" + f.upper() for f in _field_names(EngineSettings)}
    assert names == expected


@pytest.mark.parametrize("role", list(ROLE_SETTINGS))
def test_rendered_env_parses_back_to_the_chosen_settings(everything_set, role: str) -> None:
    docs, chosen = everything_set
    env = {k: v for k, v in env_of(deployment_for(docs, role)).items() if isinstance(v, str)}
    cls = ROLE_SETTINGS[role]
    assert cls.from_env(env) == _expected(cls, chosen[role])
    if role != "router":
        assert EngineSettings.from_env(env) == _expected(EngineSettings, chosen["engine"])


def test_null_settings_are_not_rendered_so_the_service_defaults_apply() -> None:
    docs = render()
    for role, cls in ROLE_SETTINGS.items():
        env = {k: v for k, v in env_of(deployment_for(docs, role)).items() if isinstance(v, str)}
        loaded = cls.from_env(env)
        for f in dataclasses.fields(cls):
            if VALUES[role]["settings"].get(camel(f.name)) is None and f.name not in SET_ELSEWHERE.get(
                role, {}
            ):
                if role in ("router", "draft") and f.name in ("target_addresses", "draft_addresses"):
                    continue  # derived from the release's Services (test_chart.py)
                if role == "router" and f.name == "auth_token_file":
                    continue  # the mounted token Secret: auth.enabled, on by default
                if f.name in TLS_DERIVED:
                    continue  # the mounted certificates: tls.enabled, on by default (secure defaults)
                assert cls.ENV_PREFIX + f.name.upper() not in env
                assert getattr(loaded, f.name) == getattr(cls(), f.name)


def test_the_model_choices_are_the_profile_registry() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    choices = schema["properties"]["engine"]["properties"]["model"]["enum"]
    assert choices == [*PROFILES, None]
