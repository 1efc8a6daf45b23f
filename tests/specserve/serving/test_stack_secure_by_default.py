"""`specserve stack` is secure with no options: mutual TLS between the services from a fresh local CA, TLS
to the router (HTTPS for its HTTP API) and a random token the router requires, kept in a 0600 file whose
path the stack prints with commands that use it. `--insecure` is plaintext without a token, and says so.

The first tests check how the command picks its tokens (no processes); the rest start the command as a
user runs it, with no security option at all (the README's main command, plus the HTTP API), and attack
it: plaintext and certificate-less clients at the target and draft, calls without the token at the router,
a scan of every process's command line for the token and Redis's password. SIGTERM (what `kill`, a
container runtime or a CI timeout sends) then stops every process and removes its temporary directory.
One such stack serves every test here: each start loads the model in two processes.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_scan import scan

from specserve.app.serve import STACK_TOKEN_ENV, stack_security
from specserve.cli import build_parser
from specserve.client import Client
from specserve.errors import InvalidArgument, Unauthenticated
from specserve.serving.stack import free_port
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.timeout(600)

OFFSETS = {"router": 0, "target": 1, "draft": 2, "redis": 3}  # --base-port layout


def stack_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["stack", *argv])


# -- how the command picks its security (no processes) --------------------------------------------------


def test_no_option_means_tls_and_a_fresh_random_token(capsys) -> None:
    first, second = stack_security(stack_args(), {}), stack_security(stack_args(), {})
    assert first.tls and first.generated and len(first.tokens) == 1
    assert len(first.tokens[0]) >= 32 and first.tokens != second.tokens
    assert capsys.readouterr().err == ""


def test_a_token_file_is_read_and_a_loose_mode_is_warned_about(tmp_path, capsys) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("# the stack's tokens\nfirst-token\n\nsecond-token\n")
    token_file.chmod(0o600)
    security = stack_security(stack_args("--token-file", str(token_file)), {})
    assert security.tls and not security.generated
    assert security.tokens == ("first-token", "second-token")
    assert capsys.readouterr().err == ""
    token_file.chmod(0o644)
    assert stack_security(stack_args("--token-file", str(token_file)), {}).tokens[0] == "first-token"
    assert "readable by other users: chmod 600" in capsys.readouterr().err


def test_a_missing_or_empty_token_file_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read the token file"):
        stack_security(stack_args("--token-file", str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(InvalidArgument, match="holds no token"):
        stack_security(stack_args("--token-file", str(tmp_path / "empty")), {})


def test_tokens_from_the_environment(capsys) -> None:
    security = stack_security(stack_args(), {STACK_TOKEN_ENV: "env-one, env-two"})
    assert security.tokens == ("env-one", "env-two") and not security.generated
    assert capsys.readouterr().err == ""


def test_a_token_on_the_command_line_still_works_with_a_warning(capsys) -> None:
    security = stack_security(stack_args("--tls", "--token", "argv-token"), {})
    assert security.tls and security.tokens == ("argv-token",)
    assert "every local user can read" in capsys.readouterr().err


def test_insecure_is_plaintext_without_a_token_and_says_so(capsys) -> None:
    security = stack_security(stack_args("--insecure"), {})
    assert not security.tls and security.tokens == ()
    assert "PLAINTEXT" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # contradictory
        stack_args("--insecure", "--tls")


# -- the command as a user runs it ------------------------------------------------------------------


@dataclass
class RunningStack:
    process: subprocess.Popen
    base_port: int
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def address(self, role: str) -> str:
        return f"localhost:{self.base_port + OFFSETS[role]}"

    def printed(self, pattern: str) -> str:
        match = re.search(pattern, self.output)
        assert match, f"no {pattern!r} in:\n{self.output}"
        return match.group(1)

    @property
    def token_file(self) -> Path:
        return Path(self.printed(r"API token \(generated for this run\), readable by you only: (\S+)"))

    @property
    def ca_file(self) -> str:
        return self.printed(r"clients verify the router with (\S+)")

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()


HTTP_OFFSET = len(OFFSETS)  # the router's HTTP API: the port after the services', checked with them


def free_base_port() -> int:
    """A block of free ports for the services and the HTTP API, checked together: an HTTP port the stack
    drew later, once its services were up, could meanwhile go to a stack of another test worker."""
    while True:
        base = free_port()
        if base + HTTP_OFFSET < 65536 and all(port_closed(base + i) for i in range(HTTP_OFFSET + 1)):
            return base


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    base = free_base_port()
    command = [sys.executable, "-m", "specserve.cli", "stack", "--base-port", str(base)]
    command += ["--http-port", str(base + HTTP_OFFSET)]
    command += ["--max-new-tokens", "4", "Name a prime number."]
    env = {k: v for k, v in os.environ.items() if k != STACK_TOKEN_ENV}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    running = RunningStack(process, base)
    reader = threading.Thread(target=lambda: running.lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while "stack serving" not in running.output:
            assert process.poll() is None, running.output
            assert time.monotonic() < deadline, running.output
            time.sleep(0.3)
        yield running
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(90)
        reader.join(10)


@pytest.mark.distributed
@pytest.mark.model
def test_the_demo_streams_over_tls_and_prints_how_to_call_it(stack) -> None:
    assert re.search(r"via router\] [1-9][0-9]* tokens", stack.output), stack.output
    assert stat.S_IMODE(stack.token_file.stat().st_mode) == 0o600
    assert stack.token not in stack.output  # the file's path is printed, never the token
    file, ca = stack.token_file, stack.ca_file
    remote = (
        f"SPECSERVE_TOKEN=$(cat {file}) specserve generate --remote {stack.address('router')} --tls-ca {ca}"
    )
    assert remote in stack.output
    assert f'curl --cacert {ca} -H "Authorization: Bearer $(cat {file})" https://localhost:' in stack.output
    assert "OpenAI-compatible API at https://localhost:" in stack.output


@pytest.mark.distributed
@pytest.mark.model
@pytest.mark.parametrize("role", ["target", "draft"])
def test_target_and_draft_refuse_plaintext_and_certificate_less_clients(stack, role) -> None:
    stubs = {"target": target_pb2_grpc.TargetServiceStub, "draft": draft_pb2_grpc.DraftServiceStub}
    requests = {"target": target_pb2.ReleaseRequest, "draft": draft_pb2.DraftReleaseRequest}
    request = requests[role](session_id="anyone")
    ca = Path(stack.ca_file).read_bytes()
    channels = {
        "plaintext": grpc.insecure_channel(stack.address(role)),
        "TLS without a client certificate": grpc.secure_channel(
            stack.address(role), grpc.ssl_channel_credentials(root_certificates=ca)
        ),
    }
    for kind, channel in channels.items():
        with channel, pytest.raises(grpc.RpcError) as error:
            stubs[role](channel).Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, kind  # no handshake


@pytest.mark.distributed
@pytest.mark.model
def test_the_router_requires_the_token(stack) -> None:
    with (
        Client(stack.address("router"), tls_ca_file=stack.ca_file) as anonymous,
        pytest.raises(Unauthenticated),
    ):
        anonymous.list_methods()
    with Client(stack.address("router"), token=stack.token, tls_ca_file=stack.ca_file) as client:
        assert client.list_methods()
    with grpc.insecure_channel(stack.address("router")) as plain:  # the router speaks TLS only
        with pytest.raises(grpc.RpcError) as error:
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.distributed
@pytest.mark.model
def test_the_http_api_is_https_and_requires_the_token(stack) -> None:
    url = stack.printed(r"OpenAI-compatible API at (\S+),") + "/models"
    assert url.startswith("https://")
    context = ssl.create_default_context(cafile=stack.ca_file)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url, context=context, timeout=30)
    assert error.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {stack.token}"})
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        assert response.status == 200


@pytest.mark.distributed
@pytest.mark.model
def test_no_command_line_shows_the_token_or_the_redis_password(stack) -> None:
    config = (stack.token_file.parent / "redis.conf").read_text()
    password = re.search(r'^requirepass "([^"]+)"$', config, re.MULTILINE).group(1)
    found = scan([stack.token, password])
    assert found.leaks == []
    assert any("serve router" in line for line in found.command_lines)
    assert any("redis-server" in line for line in found.command_lines)


@pytest.mark.distributed
@pytest.mark.model
def test_stack_streams_a_generation_and_every_process_listens(stack) -> None:
    assert re.search(r"via router\] [1-9][0-9]* tokens", stack.output), stack.output
    # Router, target, draft and Redis; the SIGTERM test below checks that they all go.
    assert not any(port_closed(stack.base_port + i) for i in range(4)), stack.output


@pytest.mark.distributed
@pytest.mark.model
def test_sigterm_stops_it_and_removes_its_directory(stack) -> None:
    directory = stack.token_file.parent
    assert directory.name.startswith("specserve-stack-")
    # A client keeps an HTTPS connection open and idle, as pooled clients do: it has nothing in flight,
    # so it must not hold the drain (20 s) while the stack stops.
    url = urllib.parse.urlsplit(stack.printed(r"OpenAI-compatible API at (\S+),"))
    context = ssl.create_default_context(cafile=stack.ca_file)
    idle = http.client.HTTPSConnection(url.hostname, url.port, context=context, timeout=30)
    idle.request("GET", "/health")
    assert idle.getresponse().read()
    started = time.monotonic()
    stack.process.terminate()
    assert stack.process.wait(90) == 0, stack.output
    assert time.monotonic() - started < 15, stack.output  # well inside one drain
    idle.close()
    assert not directory.exists()
    # Redis and the three services went with it: nothing listens on their ports any more.
    assert all(port_closed(stack.base_port + i) for i in range(4)), stack.output
