"""A router that dies mid-stream: the HTTP client sees the stream cut without `data: [DONE]` (nor an error
event), and continues it on another router from the tokens it has (`GET /v1/streams/{id}` with the last
event's `id:`), ending with exactly the text an uncut stream gives. Another tenant gets the 404 an unknown
stream gets. Real routers (SIGKILL) in front of the shared stack, Redis and the models."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from router_process import router_env, router_process

from specserve.serving.stack import LocalStack, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = {"alice": "resume-token-alice", "bob": "resume-token-bob"}
BODY = {
    "messages": [{"role": "user", "content": "Count from one to forty in words, separated by commas."}],
    "max_tokens": 64,
    "temperature": 0,
    "method": "target",
    "ignore_eos": True,
    "stream": True,
}
KILL_AFTER_EVENTS = 4


def headers(tenant: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}", **extra}


@dataclass
class Events:
    """What a client read of a stream: the text, the last event's `id:`, the stream id, how it ended."""

    text: str = ""
    last_id: int | None = None
    stream_id: str = ""
    done: bool = False
    errors: list[dict] = field(default_factory=list)
    count: int = 0

    def read(self, lines: Iterator[str], stop_after: int | None = None) -> None:
        for line in lines:
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("id: "):
                self.last_id = int(line.removeprefix("id: "))
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                    continue
                self.stream_id = chunk["id"]
                self.text += chunk["choices"][0]["delta"].get("content") or ""
                self.count += 1
            elif line == "" and stop_after is not None and self.count >= stop_after:
                return  # at an event's end


def router(stack: LocalStack, log: Path):
    env = router_env(stack, http_port=free_port(), auth_tokens=",".join(TOKENS.values()))
    return f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1", router_process(env, log)


def test_a_stream_cut_by_a_dying_router_is_detected_and_continued_elsewhere(shared_stack, tmp_path) -> None:
    first_url, first_router = router(shared_stack, tmp_path / "first.log")
    cut = Events()
    with (
        first_router as process,
        requests.post(
            f"{first_url}/chat/completions", json=BODY, headers=headers("alice"), timeout=120, stream=True
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines(decode_unicode=True)
        cut.read(lines, stop_after=KILL_AFTER_EVENTS)
        process.send_signal(signal.SIGKILL)
        process.wait()
        with pytest.raises(requests.RequestException):  # the connection is cut: the client cannot miss it
            cut.read(lines)
    assert not cut.done and not cut.errors  # how a client tells a cut from an end: no [DONE]
    assert cut.stream_id.startswith("chatcmpl-") and cut.last_id is not None and cut.last_id >= 1

    second_url, second_router = router(shared_stack, tmp_path / "second.log")
    with second_router:
        resume_url = f"{second_url}/streams/{cut.stream_id}"
        # Another tenant: exactly the answer a stream id nobody has gets.
        theirs = requests.get(resume_url, headers=headers("bob"), timeout=60)
        unknown_id = "chatcmpl-" + "0" * 32
        unknown = requests.get(f"{second_url}/streams/{unknown_id}", headers=headers("bob"), timeout=60)
        assert theirs.status_code == unknown.status_code == 404
        session_id, unknown_session = (
            cut.stream_id.removeprefix("chatcmpl-"),
            unknown_id.removeprefix("chatcmpl-"),
        )
        assert theirs.json()["error"]["message"].replace(session_id, "ID") == unknown.json()["error"][
            "message"
        ].replace(unknown_session, "ID")

        rest = Events()
        # The server-sent events' own reconnection header: the last `id:` read.
        with requests.get(
            resume_url,
            headers=headers("alice", **{"Last-Event-ID": str(cut.last_id)}),
            timeout=120,
            stream=True,
        ) as response:
            assert response.status_code == 200, response.text
            rest.read(response.iter_lines(decode_unicode=True))
        assert rest.done and not rest.errors and rest.stream_id == cut.stream_id
        assert rest.last_id == BODY["max_tokens"]

        uncut = requests.post(
            f"{second_url}/chat/completions",
            json=BODY | {"stream": False},
            headers=headers("alice"),
            timeout=120,
        ).json()
        assert cut.text + rest.text == uncut["choices"][0]["message"]["content"]
