"""The OpenAI-compatible HTTP API, spoken to by the official `openai` client and by `curl`, against a real
router in front of the real stack (target, draft, Redis, the default model).

Greedy output must be the gRPC SDK's, token for token; stop strings, seeds, usage and streaming behave as
OpenAI documents them; bad requests get OpenAI's error object with the right status; a client that
disconnects frees its session and its slot.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis

from services.router.state import SessionState, scoped_session_id
from specserve.client import Client, Completion
from specserve.serving.auth import principal

pytestmark = [pytest.mark.distributed, pytest.mark.model]

PROMPT = "Write a haiku about rain."
METHOD = "glide"
MAX_TOKENS = 24
TIMEOUT_SECONDS = 120


@pytest.fixture(scope="module")
def client(http_router) -> openai.OpenAI:
    # max_retries=0: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(
        base_url=http_router.base_url, api_key=http_router.token, max_retries=0, timeout=TIMEOUT_SECONDS
    )


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    [served] = client.models.list().data
    return served.id


@pytest.fixture(scope="module")
def grpc_reference(http_router):
    """The gRPC SDK's greedy completion of PROMPT (the router applies the chat template to it), streamed:
    one chunk per round, each with its round's boundaries."""
    with Client(http_router.grpc_address, token=http_router.token) as sdk:
        chunks = list(
            sdk.stream(
                PROMPT, method=METHOD, max_new_tokens=MAX_TOKENS, temperature=0.0, timeout=TIMEOUT_SECONDS
            )
        )
    *rounds, last = chunks
    assert all(
        c.round is not None and 0 <= c.round.num_accepted_tokens <= c.round.num_draft_tokens for c in rounds
    )
    assert rounds[0].round.num_draft_tokens == 0  # the prefill's token
    assert last.round is None and last.finish_reason == "length"
    # The last round may end inside its accepted block (max tokens): its cut tokens count in the stats only.
    accepted = sum(c.round.num_accepted_tokens for c in rounds)
    assert 0 <= last.stats["num_accepted_tokens"] - accepted <= rounds[-1].round.num_draft_tokens
    return Completion(
        last.session_id,
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.token_ids],
        "length",
        {},
    )


def chat(client: openai.OpenAI, model: str, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": PROMPT}])
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, **kwargs)


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(model).id == model


def test_greedy_chat_equals_the_grpc_sdk_token_for_token(client, model, grpc_reference) -> None:
    response = chat(client, model, extra_body={"method": METHOD})
    choice = response.choices[0]
    assert choice.message.content == grpc_reference.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == len(grpc_reference.token_ids) == MAX_TOKENS
    assert response.usage.total_tokens == response.usage.prompt_tokens + MAX_TOKENS
    stats = response.usage.model_extra["specserve"]
    assert stats["method"] == METHOD
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["mean_accepted_length"] >= 1.0

    # Streamed: one chunk per round, whose token ids (the `specserve.round` extension) are the SDK's.
    stream = chat(
        client, model, extra_body={"method": METHOD}, stream=True, stream_options={"include_usage": True}
    )
    token_ids, text, rounds, finish, usage = [], "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        round_ = (chunk.model_extra or {}).get("specserve", {}).get("round")
        if round_ is not None:
            rounds.append(round_)
            token_ids += round_["token_ids"]
            assert round_["accepted_text"] + round_["target_text"] == chunk.choices[0].delta.content
            assert 0 <= round_["num_accepted_tokens"] <= round_["num_draft_tokens"]
    assert token_ids == grpc_reference.token_ids
    assert text == grpc_reference.text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert rounds[0]["num_draft_tokens"] == 0  # the prefill's token: the target's own
    # usage counts every draft token the target accepted; a round reports only the accepted tokens it
    # streams, and max_tokens may cut the last round inside its accepted tokens.
    streamed = sum(r["num_accepted_tokens"] for r in rounds)
    last = rounds[-1]
    cut = last["num_draft_tokens"] - len(last["token_ids"])  # accepted draft tokens past max_tokens, at most
    assert streamed <= usage.model_extra["specserve"]["num_accepted_tokens"] <= streamed + max(cut, 0)


def test_multi_turn_chat_and_a_system_message(client, model) -> None:
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
    ]
    response = chat(client, model, messages=messages, max_completion_tokens=12)
    assert "Rome" in response.choices[0].message.content
    assert response.usage.completion_tokens <= 12


def test_completions_stream_and_not_agree(client, model) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert "Paris" in whole.choices[0].text
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text


def test_stop_strings_end_the_text_before_them(client, model, grpc_reference, http_router) -> None:
    words = grpc_reference.text.split()
    stop = max(words[len(words) // 2 :], key=len)  # a word from the second half of the greedy answer
    expected = grpc_reference.text[: grpc_reference.text.index(stop)]
    response = chat(client, model, stop=[stop, "never generated"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = chat(client, model, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    with Client(http_router.grpc_address, token=http_router.token) as sdk:  # the gRPC stream's text too
        over_grpc = sdk.generate(
            PROMPT, method=METHOD, max_new_tokens=MAX_TOKENS, stop=[stop], timeout=TIMEOUT_SECONDS
        )
    assert over_grpc.text == expected and over_grpc.finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer(client, model) -> None:
    def sample(seed: int) -> str:
        return chat(client, model, temperature=1.0, seed=seed, max_tokens=8).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first  # it did sample: another seed, another answer


def test_logprobs_come_from_the_targets_own_forward(client, model) -> None:
    response = chat(client, model, logprobs=True, top_logprobs=3, max_tokens=6)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the chosen token is the top one
        assert entry.top_logprobs[0].token == entry.token


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"n": 2}, "n", "n must be 1"),
        ({"extra_body": {"method": "no-such-method"}}, None, "unknown method"),
        ({"temperature": -1}, None, "temperature"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"extra_body": {"bogus": 1}}, "bogus", "unrecognized request argument"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "needs tool_call_id"),
        ({"messages": []}, "messages", "messages"),
        ({"extra_body": {"method": "mcsd-target-init"}, "temperature": 0.7}, "method", "lossy"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ],
)
def test_bad_requests_get_400_with_openais_error_object(client, model, kwargs, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, model, **kwargs)
    body = raised.value.body
    assert raised.value.status_code == 400
    assert body["type"] == "invalid_request_error"
    assert message.lower() in body["message"].lower()
    if param is not None:
        assert body["param"] == param


def test_a_missing_or_wrong_token_gets_401(http_router, model) -> None:
    wrong = openai.OpenAI(base_url=http_router.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        chat(wrong, model)
    assert raised.value.status_code == 401 and raised.value.body["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(http_router.base_url + "/models", timeout=30)
    assert http_error.value.code == 401
    with urllib.request.urlopen(http_router.page_url + "health", timeout=30) as health:  # probes need none
        assert json.loads(health.read()) == {"status": "ok"}


def test_unknown_model_url_and_method_get_404_and_405(client, http_router) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        chat(client, "no-such-model")
    assert raised.value.body["code"] == "model_not_found"
    for method, path, status in (("GET", "/nothing", 404), ("GET", "/chat/completions", 405)):
        request = urllib.request.Request(
            http_router.base_url + path,
            method=method,
            headers={"Authorization": f"Bearer {http_router.token}"},
        )
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(request, timeout=30)
        assert http_error.value.code == status
        assert set(json.loads(http_error.value.read())["error"]) == {"message", "type", "param", "code"}


def test_no_reachable_target_gets_503(lone_router: str) -> None:
    unserved = openai.OpenAI(base_url=lone_router, api_key="unused", max_retries=0, timeout=TIMEOUT_SECONDS)
    with pytest.raises(openai.APIStatusError) as raised:
        unserved.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert raised.value.status_code == 503
    assert raised.value.body["type"] == "service_unavailable_error"


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests(own_router, model) -> None:
    base_url, process = own_router
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_SECONDS)
    stream = chat(client, model, max_tokens=12, stream=True)
    chunks = [next(iter(stream))]
    process.send_signal(signal.SIGTERM)  # the drain starts with this stream still running
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert (
        sum(
            len(c.model_extra["specserve"]["round"]["token_ids"])
            for c in chunks
            if c.model_extra.get("specserve", {}).get("round")
        )
        == 12
    )
    assert process.wait(30) == 0
    with pytest.raises(openai.APIConnectionError):
        chat(client, model, max_tokens=2)


def test_an_oversized_body_gets_413(client, model, http_router) -> None:
    huge = "word " * (http_router.max_body_bytes // 5 + 10)
    with pytest.raises(openai.APIStatusError) as raised:
        chat(client, model, messages=[{"role": "user", "content": huge}])
    assert raised.value.status_code == 413
    assert raised.value.body["code"] == "request_too_large"


def test_a_deadline_gets_504_and_frees_the_session(client, model) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        chat(client, model, max_tokens=400, extra_body={"timeout_seconds": 0.5, "ignore_eos": True})
    assert raised.value.status_code == 504
    assert chat(client, model, max_tokens=2).usage.completion_tokens == 2  # its slot is free again


def session_running(http_router, session_id: str) -> bool:
    """Whether the router's tenant's session of that id is running (its key in Redis is the tenant's own:
    services/router/state.py, scoped_session_id)."""
    key = SessionState.key(scoped_session_id(principal(http_router.token), session_id))
    status = redis.Redis.from_url(http_router.stack.redis_url).hget(key, "status")
    return status is not None and b"running" in status


def test_overload_gets_429_and_a_disconnect_cancels_the_session(client, model, http_router) -> None:
    long = {"max_tokens": 400, "extra_body": {"ignore_eos": True}, "stream": True}
    streams = [chat(client, model, **long) for _ in range(http_router.max_concurrent)]
    session_ids = [next(iter(stream)).id.removeprefix("chatcmpl-") for stream in streams]
    assert all(session_running(http_router, s) for s in session_ids)
    with pytest.raises(openai.RateLimitError) as raised:
        chat(client, model, max_tokens=2)
    assert raised.value.status_code == 429
    for stream in streams:
        stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while any(session_running(http_router, s) for s in session_ids):
        assert time.monotonic() < deadline, "a disconnected client's session kept running"
        time.sleep(0.2)
    assert chat(client, model, max_tokens=2).usage.completion_tokens == 2  # the slots are free again


def sessions_created_since(stack, since: float) -> dict[bytes, bytes | None]:
    """Session key -> its status, for sessions created after `since` (Unix seconds)."""
    store = redis.Redis.from_url(stack.redis_url)
    found = {}
    for key in store.scan_iter("specserve:session:*"):
        if store.type(key) == b"hash":  # the session records (not their token lists)
            created, status = store.hmget(key, "created_unix", "status")
            if created is not None and json.loads(created) >= since:
                found[key] = status
    return found


def test_a_client_that_goes_away_from_a_plain_request_cancels_it(http_router, model) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 400,
            "ignore_eos": True,
        }
    ).encode()
    host, port = http_router.base_url.removeprefix("http://").split("/")[0].split(":")
    since = time.time()
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {http_router.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 60
    while not (
        running := [
            k for k, v in sessions_created_since(http_router.stack, since).items() if v == b'"running"'
        ]
    ):
        assert time.monotonic() < deadline, "the request's session never started"
        time.sleep(0.1)
    connection.close()  # the client goes away while its (non-streamed) answer is being generated
    deadline = time.monotonic() + 30
    while any(sessions_created_since(http_router.stack, since).get(key) == b'"running"' for key in running):
        assert time.monotonic() < deadline, "the abandoned request's session kept running"
        time.sleep(0.2)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_reads_the_event_stream_to_done(http_router, model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True}
    result = subprocess.run(
        ["curl", "-N", "-sS", "--fail-with-body", f"{http_router.base_url}/completions",
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {http_router.token}",
         "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=True,
    )  # fmt: skip
    events = [e for e in result.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    # Each event: its data line, then its id, the tokens the client has once it read it (docs/api.md).
    data, ids = zip(*(e.split("\n") for e in events[:-1]), strict=True)
    chunks = [json.loads(d.removeprefix("data: ")) for d in data]
    assert ids[-1] == "id: 6" and all(i.startswith("id: ") for i in ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (
        sum(len(c["specserve"]["round"]["token_ids"]) for c in chunks if "round" in c.get("specserve", {}))
        == 6
    )


def test_the_http_layer_imports_no_torch() -> None:
    code = (
        "import sys, services.router.http.app, services.router.http.server; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
