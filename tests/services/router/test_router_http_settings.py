"""The HTTP API's settings: read from SPECSERVE_ROUTER_HTTP_*, checked, and set by the local stack."""

from __future__ import annotations

import pytest

from specserve.errors import InvalidArgument
from specserve.serving.settings import RouterServiceSettings
from specserve.serving.stack import LocalStack


def test_the_http_api_is_off_unless_a_port_is_set() -> None:
    assert RouterServiceSettings.from_env({}).http_port == 0
    settings = RouterServiceSettings.from_env(
        {"SPECSERVE_ROUTER_HTTP_PORT": "8080", "SPECSERVE_ROUTER_HTTP_MAX_BODY_BYTES": "4096"}
    )
    assert (settings.http_port, settings.http_max_body_bytes) == (8080, 4096)


@pytest.mark.parametrize(
    ("name", "value"), [("HTTP_PORT", "70000"), ("HTTP_PORT", "-1"), ("HTTP_MAX_BODY_BYTES", "10")]
)
def test_bad_http_settings_are_refused(name: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match=name.lower()):
        RouterServiceSettings.from_env({f"SPECSERVE_ROUTER_{name}": value})


def test_the_local_stack_serves_the_api_on_request(tmp_path) -> None:
    assert LocalStack(log_dir=tmp_path).http_url is None
    assert "SPECSERVE_ROUTER_HTTP_PORT" not in LocalStack(log_dir=tmp_path).role_env("router")
    stack = LocalStack(log_dir=tmp_path, http_port=0)  # 0: a free port
    assert stack.http_port > 0
    assert stack.role_env("router")["SPECSERVE_ROUTER_HTTP_PORT"] == str(stack.http_port)
    assert stack.http_url == f"http://localhost:{stack.http_port}/v1"
    assert stack.playground_url == f"http://localhost:{stack.http_port}/"
