"""A stream whose session fails while the router process lives ends with an error event: here Redis goes
away mid-stream for longer than the router retries it. The response still ends properly (the last
chunk of its chunked body arrives), so a client can tell this from a router that died, which cuts the
connection with neither [DONE] nor an error.

The router is a process of the test's own, in front of the shared stack's target and draft but with a
Redis of its own, which the test kills (the shared stack's must stay up).
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from router_process import router_env, router_process

from specserve.serving.stack import LocalStack, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]


def test_redis_gone_past_the_retries_ends_the_stream_with_an_error_event(
    shared_stack, tmp_path: Path
) -> None:
    with LocalStack(roles=(), log_dir=tmp_path / "redis") as own_redis:  # Redis alone
        env = router_env(
            shared_stack, http_port=free_port(), redis_url=own_redis.redis_url, redis_retry_seconds=1
        )
        with router_process(env, tmp_path / "router.log"):
            connection = http.client.HTTPConnection(
                "localhost", int(env["SPECSERVE_ROUTER_HTTP_PORT"]), timeout=120
            )
            body = {
                "messages": [{"role": "user", "content": "Count from one to a thousand."}],
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            connection.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            assert response.status == 200
            events = []
            for line in response:  # http.client raises IncompleteRead if the body is cut short
                if line.startswith(b"data: "):
                    events.append(line.removeprefix(b"data: ").strip())
                    if len(events) == 2:  # the role chunk, then the first round
                        own_redis.kill("redis")
            connection.close()
    assert b"[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "unavailable")
    assert "redis" in error["message"]
