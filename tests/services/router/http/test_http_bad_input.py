"""Bad HTTP requests against a real router in front of the real stack, sent byte for byte with
`http.client`: each gets its 4xx with OpenAI's error object, never a 500, and the keep-alive connection
stays usable. Oversized prompts are refused by their size before the tokenizer sees them, body fields
keep their JSON types (no coercion), a cross-site form or text/plain POST starts nothing, and the OpenAPI
schema lists the documented routes.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path

import pytest
import redis

from specserve.errors import MAX_MESSAGE_CHARS

pytestmark = [pytest.mark.distributed, pytest.mark.model]

JSON = "application/json"
ERROR_KEYS = {"message", "type", "param", "code"}
API_DOC = Path(__file__).parents[4] / "docs" / "api.md"


class Api:
    """One keep-alive connection to a router's HTTP API."""

    def __init__(self, address: str, token: str | None = None) -> None:
        host, port = address.split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=60)
        self.token = token

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str | None = JSON,
        **headers: str,
    ) -> tuple[int, dict[str, str], bytes]:
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        self.connection.request(method, path, body, headers)
        response = self.connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()

    def post(self, path: str, body: bytes | str | dict, **kwargs) -> tuple[int, dict]:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        status, _, data = self.send("POST", path, raw if isinstance(raw, bytes) else raw.encode(), **kwargs)
        return status, json.loads(data)


@pytest.fixture
def api(http_router):
    api = Api(http_router.base_url.removeprefix("http://").split("/")[0], http_router.token)
    yield api
    api.connection.close()


@pytest.fixture
def open_api(open_router):
    api = Api(open_router)
    yield api
    api.connection.close()


def assert_error(status: int, body: dict, expected_status: int = 400) -> dict:
    assert status == expected_status, body
    assert set(body["error"]) == ERROR_KEYS
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def assert_still_open(api: Api) -> None:
    """The connection that carried the bad request serves the next one (the server did not close it)."""
    sock = api.connection.sock
    assert sock is not None, "the server closed the connection"
    status, _, data = api.send("GET", "/health", content_type=None)
    assert (status, json.loads(data)) == (200, {"status": "ok"})
    assert api.connection.sock is sock


def sessions_in_redis(stack) -> set[bytes]:
    store = redis.Redis.from_url(stack.redis_url)
    return {k for k in store.scan_iter("specserve:session:*") if store.type(k) == b"hash"}


# -- bodies the parser or the tokenizer used to fail on with a 500 -------------------------------------

DEEP = 1000


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/chat/completions", b'{"messages":' + b"[" * DEEP + b"]" * DEEP + b"}", "nested"),
        ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, "nested"),
        (
            "/v1/chat/completions",
            rb'{"messages":[{"role":"user","content":"a\ud800b"}],"max_tokens":4}',
            "surrogate",
        ),
        ("/v1/completions", rb'{"prompt":"a\udc00b","max_tokens":4}', "surrogate"),
        ("/v1/completions", rb'{"prompt":["\ud800"],"max_tokens":4}', "surrogate"),
        ("/v1/completions", b'{"prompt":"a\xed\xa0\x80b","max_tokens":4}', "utf-8"),
        ("/v1/completions", b'{"prompt":"\xff","max_tokens":4}', "utf-8"),
    ],
    ids=["deep-field", "deep-body", "surrogate-chat", "surrogate-prompt", "surrogate-list", "cesu", "byte"],
)
def test_unparsable_bodies_get_400_and_the_connection_stays_open(api, path, body, words) -> None:
    error = assert_error(*api.post(path, body))
    assert "not valid JSON" in error["message"] and words in error["message"].lower()
    assert_still_open(api)


# -- size before tokenizing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        (
            "/v1/chat/completions",
            "messages",
            {"messages": [{"role": "user", "content": "lorem ipsum " * 83_000}]},
        ),
        (
            "/v1/chat/completions",
            "messages",
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "lorem ipsum " * 41_500}]}]
                * 2
            },
        ),
        ("/v1/completions", "prompt", {"prompt": ["lorem ipsum " * 83_000]}),
    ],
    ids=["chat", "chat-parts", "completions"],
)
def test_a_prompt_too_long_for_max_prompt_tokens_is_refused_before_it_is_tokenized(
    open_api, path, field, body
) -> None:
    raw = json.dumps(body).encode()
    assert 900_000 < len(raw) < 1024 * 1024  # under the body limit: the prompt's own bound refuses it
    start = time.perf_counter()
    error = assert_error(*open_api.post(path, raw))
    elapsed = time.perf_counter() - start
    # The character bound's message (the gRPC API's), not the token count's: nothing was tokenized.
    assert re.fullmatch(r"the prompt has \d+ characters; more than \d+ tokens can hold", error["message"])
    assert error["param"] == field
    assert elapsed < 2.0  # tokenizing it took over a second
    assert_still_open(open_api)


def test_a_body_over_the_limit_gets_413_before_it_is_read(open_api) -> None:
    raw = json.dumps({"prompt": "x" * (2 * 1024 * 1024)}).encode()
    error = assert_error(*open_api.post("/v1/completions", raw), expected_status=413)
    assert error["code"] == "request_too_large"


# -- strict types ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"stream": "true"}, "stream"),
        ("/v1/chat/completions", {"temperature": True}, "temperature"),
        ("/v1/chat/completions", {"top_p": False}, "top_p"),
        ("/v1/chat/completions", {"max_tokens": "2"}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 2.5}, "max_tokens"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"ignore_eos": "false"}, "ignore_eos"),
        ("/v1/chat/completions", {"seed": True}, "seed"),
        ("/v1/chat/completions", {"temperature": "NaN"}, "temperature"),
        ("/v1/completions", {"prompt": [True]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_fields_keep_their_json_types(api, path, fields, param) -> None:
    body = {"max_tokens": 2} | fields
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    error = assert_error(*api.post(path, body))
    assert error["param"].split(".")[0] == param


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_non_finite_numbers_are_refused(api, value) -> None:
    raw = '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"timeout_seconds":VALUE}'
    raw = raw.replace("VALUE", value)  # not JSON that json.dumps writes
    error = assert_error(*api.post("/v1/chat/completions", raw))
    assert error["param"] == "timeout_seconds"


# -- echoed input stays short ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "Hi"}], "method": "m" * 60_000},
        {"messages": [{"role": "user", "content": "Hi"}], "model": "m" * 60_000},
        {"messages": [{"role": "user", "content": "Hi"}], "k" * 60_000: 1},
    ],
    ids=["method", "model", "field-name"],
)
def test_error_messages_never_echo_a_huge_value(api, body) -> None:
    status, response = api.post("/v1/chat/completions", body)
    assert status in (400, 404)
    assert len(response["error"]["message"]) <= MAX_MESSAGE_CHARS
    assert response["error"]["param"] is None or len(response["error"]["param"]) < 200


# -- cross-site requests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
def test_a_post_that_is_not_json_starts_no_generation(open_api, shared_stack, content_type) -> None:
    """What a page on another site can send without a CORS preflight, with auth off: refused."""
    before = sessions_in_redis(shared_stack)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, response = open_api.post(
        "/v1/chat/completions", body, content_type=content_type, Origin="https://evil.example"
    )
    error = assert_error(status, response, expected_status=415)
    assert error["code"] == "unsupported_media_type"
    assert sessions_in_redis(shared_stack) == before
    assert_still_open(open_api)


def test_no_other_origin_may_post(open_api) -> None:
    """The preflight a browser sends before a cross-site JSON POST gets no CORS grant."""
    status, headers, _ = open_api.send(
        "OPTIONS",
        "/v1/chat/completions",
        content_type=None,
        Origin="https://evil.example",
        **{"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert status >= 400
    assert not any(name.startswith("access-control-allow") for name in headers)


def test_json_with_a_charset_is_json(open_api) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    status, response = open_api.post(
        "/v1/chat/completions", body, content_type="application/json; charset=utf-8"
    )
    assert status == 200, response
    assert response["usage"]["completion_tokens"] >= 1


# -- the OpenAPI schema ---------------------------------------------------------------------------------


def documented_routes() -> set[tuple[str, str]]:
    """(method, path) of every route in docs/api.md's route table."""
    routes = set()
    for line in API_DOC.read_text().splitlines():
        for method, path in re.findall(r"`(GET|POST) (/[^`]*)`", line if line.startswith("| `") else ""):
            routes.add((method.lower(), path))
    return routes


def test_the_openapi_schema_lists_the_documented_routes(api) -> None:
    status, headers, data = api.send("GET", "/openapi.json", content_type=None)
    assert status == 200 and headers["content-type"].startswith(JSON)
    schema = json.loads(data)
    documented = documented_routes()
    assert {("post", "/v1/chat/completions"), ("get", "/openapi.json")} <= documented
    assert len(documented) >= 8
    for method, path in documented - {("get", "/openapi.json")}:  # the schema does not list itself
        assert method in schema["paths"].get(path, {}), f"{method.upper()} {path} is not in /openapi.json"
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"][JSON]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "max_tokens", "stream", "method"} <= set(body["properties"])
    assert "messages" in body["required"]
    assert {"400", "413", "415"} <= set(chat["responses"])
