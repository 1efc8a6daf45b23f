"""Spans cost nothing where nothing exports them: without an exporter a process installs no provider, no
gRPC interceptor and no span around its batched forwards; with one, all of them. Each case runs in a
fresh interpreter, as a service process configures tracing once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json
from specserve.serving import telemetry
from specserve.serving.model_thread import ModelThread
telemetry.configure_tracing("target")
thread = ModelThread("probe")
print(json.dumps({
    "enabled": telemetry.enabled(),
    "interceptors": len(telemetry.server_interceptors()),
    "batch_spans": thread.scheduler.batch_scope is not None,
    "traced_channel": type(telemetry.traced_channel("localhost:1", [])).__name__,
}))
thread.close()
"""


def probe(exporter: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRACES_EXPORTER"] = exporter
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_an_exporter_no_span_is_built():
    found = probe("none")
    assert found["enabled"] is False and found["interceptors"] == 0 and found["batch_spans"] is False
    assert "Intercept" not in str(found["traced_channel"])


def test_with_an_exporter_requests_and_forwards_are_traced():
    found = probe("console")
    assert found["enabled"] is True and found["interceptors"] == 1 and found["batch_spans"] is True
    assert "Intercept" in str(found["traced_channel"])
