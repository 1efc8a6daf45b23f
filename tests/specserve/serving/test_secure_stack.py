"""`specserve stack --tls --token ...` as a user runs it, under attack and under faults. One stack for the
module (the model loads once): mutual TLS between the services (a local CA issued with `cryptography`),
bearer tokens at the router, Redis with a password and append-only persistence, the stack supervising
its children.

- tokens: no or a wrong token gets UNAUTHENTICATED with one fixed message (SDK and CLI); a session is
  bound to its creator (Resume and Cancel with another token get NOT_FOUND, as an unknown id);
- peers: the target refuses plaintext and certificates of the wrong name; StreamKV is the draft's alone;
- faults: SIGKILL of Redis, the router and the target mid-generation: each is restarted by the stack
  (with its log line) while the others keep serving, and the SDK with its default retries finishes with
  token-identical output;
- leases: target and draft sessions nobody renews (a router that died, and no client resumed them)
  are released within seconds, long before the idle timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from pinned_costs import pinned_env

from specserve.client import Client
from specserve.errors import NotFound, Unauthenticated, Unavailable
from specserve.serving import tls
from specserve.serving.stack import free_port
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(600)]

TOKENS = ("token-alice", "token-bob")
LEASE_SECONDS = 4  # the idle timeout stays at its default (600 s): only a lease releases within the tests
PROMPT = "Count from one to thirty in words, separated by commas."
NEW_TOKENS = 32
OFFSETS = {"router": 0, "target": 1, "draft": 2, "redis": 3}  # --base-port layout


def _read_proc(path: Path) -> str:
    """A /proc file's text, or "" when its thread or process has exited since it was listed."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@dataclass
class Stack:
    process: subprocess.Popen
    base_port: int
    tls_dir: Path
    lines: list[str] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def address(self, role: str) -> str:
        return f"localhost:{self.base_port + OFFSETS[role]}"

    def files(self, name: str) -> tls.TlsFiles:
        d = self.tls_dir
        return tls.TlsFiles(str(d / f"{name}.crt"), str(d / f"{name}.key"), str(d / "ca.crt"))

    def child(self, role: str) -> int:
        """The pid of the stack's child serving `role` (its current incarnation)."""
        needle = "redis-server" if role == "redis" else f"serve {role}"
        found = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for pid in _read_proc(task / "children").split():
                if needle in _read_proc(Path(f"/proc/{pid}/cmdline")).replace("\0", " "):
                    found.append(int(pid))
        (pid,) = found
        return pid

    def gauge(self, role: str, name: str) -> float:
        # With TLS the metrics ports ask for a client certificate from the stack's CA.
        client = self.files(tls.CLIENT_NAME)
        context = ssl.create_default_context(cafile=client.ca_file)
        context.load_cert_chain(client.cert_file, client.key_file)
        url = f"https://127.0.0.1:{self.metrics_ports[role]}/metrics"
        text = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
        (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
        return value

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + "".join(self.lines)
            time.sleep(0.3)


def free_base_port() -> int:
    while True:
        base = free_port()
        ports = range(base, base + 4)
        if base + 3 < 65536 and all(socket.socket().connect_ex(("127.0.0.1", p)) != 0 for p in ports):
            return base


def free_port_outside(base: int) -> int:
    """A free port that is none of the stack's own (base .. base + 3), which are not bound yet."""
    while (port := free_port()) in range(base, base + 4):
        pass
    return port


@pytest.fixture(scope="module")
def stack(pinned_costs: Path) -> Iterator[Stack]:
    base = free_base_port()
    command = [sys.executable, "-m", "specserve.cli", "stack", "--base-port", str(base), "--tls"]
    command += [arg for token in TOKENS for arg in ("--token", token)]
    command += ["--max-new-tokens", "4", "Name a prime number."]
    metrics_ports = {"target": free_port_outside(base), "draft": free_port_outside(base)}
    env = os.environ | {
        "SPECSERVE_TARGET_SESSION_LEASE_SECONDS": str(LEASE_SECONDS),
        "SPECSERVE_DRAFT_SESSION_LEASE_SECONDS": str(LEASE_SECONDS),
        "SPECSERVE_TARGET_METRICS_PORT": str(metrics_ports["target"]),
        "SPECSERVE_DRAFT_METRICS_PORT": str(metrics_ports["draft"]),
        "SPECSERVE_ROUTER_REDIS_RETRY_SECONDS": "30",
        "SPECSERVE_ROUTER_TARGET_TIMEOUT_SECONDS": "120",  # rides out the target's restart (model load)
        **pinned_env(pinned_costs),  # what this tests is not the costs: none measured at start
    }
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    running = Stack(process, base, Path(), metrics_ports=metrics_ports)
    reader = threading.Thread(target=lambda: running.lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        running.wait_for(r"stack serving", 300)
        assert re.search(r"via router\] [1-9][0-9]* tokens", "".join(running.lines))  # the demo, over TLS
        running.tls_dir = Path(running.wait_for(r"clients verify the router with (\S+)", 5).group(1)).parent
        yield running
    finally:
        process.terminate()
        assert process.wait(90) == 0, "".join(running.lines)
        reader.join(10)


def client(stack: Stack, token: str | None = TOKENS[0], **options: float) -> Client:
    """The SDK as a user makes it: its default retries outlast a router restart (the supervisor's backoff,
    the router's start, the dead router's Redis lease)."""
    return Client(stack.address("router"), token=token, tls_ca_file=str(stack.tls_dir / "ca.crt"), **options)


@pytest.fixture(scope="module")
def reference(stack) -> list[int]:
    with client(stack) as c:
        return c.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, timeout=300).token_ids


def test_calls_without_a_valid_token_are_unauthenticated_with_no_detail(stack) -> None:
    for token in (None, "token-mallory", TOKENS[0][:-1]):
        with client(stack, token) as c, pytest.raises(Unauthenticated) as error:
            c.list_methods()
        assert str(error.value) == "missing or invalid credentials"
    with client(stack, TOKENS[1]) as c:
        assert c.list_methods()


def cli_generate(stack: Stack, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "specserve.cli", "generate", "--remote", stack.address("router")]
    command += [*extra, "--tls-ca", str(stack.tls_dir / "ca.crt"), "--max-new-tokens", "4", "--json", "Hi."]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_cli_client_needs_the_token(stack) -> None:
    done = cli_generate(stack, "--token", TOKENS[1])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"]
    refused = cli_generate(stack)
    assert refused.returncode == 2 and "missing or invalid credentials" in refused.stderr


def test_a_session_is_bound_to_its_creator(stack, reference) -> None:
    with client(stack) as alice:
        done = alice.generate(PROMPT, max_new_tokens=4, timeout=300)
    with client(stack, TOKENS[1]) as bob:
        with pytest.raises(NotFound):
            list(bob.resume(done.session_id))
        with pytest.raises(NotFound):
            bob.cancel(done.session_id)
    with client(stack) as alice:
        resumed = [t for chunk in alice.resume(done.session_id) for t in chunk.token_ids]
        assert resumed == done.token_ids
        alice.cancel(done.session_id)


def secure_channel(stack: Stack, files: tls.TlsFiles, role: str) -> grpc.Channel:
    read = lambda path: Path(path).read_bytes()  # noqa: E731
    credentials = grpc.ssl_channel_credentials(
        read(files.ca_file), read(files.key_file), read(files.cert_file)
    )
    return grpc.secure_channel(stack.address(role), credentials)


def test_internal_services_accept_only_the_peers_they_trust(stack, reference) -> None:
    request = target_pb2.ReleaseRequest(session_id="anyone")
    with grpc.insecure_channel(stack.address("target")) as plain:  # no TLS at all: no handshake
        with pytest.raises(grpc.RpcError) as error:
            target_pb2_grpc.TargetServiceStub(plain).Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate from the same CA, but a client's, not the router's.
    with secure_channel(stack, stack.files(tls.CLIENT_NAME), "target") as channel:
        with pytest.raises(grpc.RpcError) as error:
            target_pb2_grpc.TargetServiceStub(channel).Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as error:
            target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                target_pb2.GetModelInfoRequest(), timeout=10
            )
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The draft's certificate opens the KV feed and the model info (the costs it sizes trees by) only.
    with secure_channel(stack, stack.files(tls.DRAFT_NAME), "target") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=10).costs.verify
    with secure_channel(stack, stack.files(tls.ROUTER_NAME), "target") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert not stub.Release(request, timeout=10).released
        with pytest.raises(grpc.RpcError) as error:
            list(stub.StreamKV(target_pb2.StreamKVRequest(session_id="anyone"), timeout=10))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_target_and_draft_sessions_nobody_renews_are_released(stack, reference) -> None:
    router_files = stack.files(tls.ROUTER_NAME)
    with (
        secure_channel(stack, router_files, "target") as target_channel,
        secure_channel(stack, router_files, "draft") as draft_channel,
    ):
        target = target_pb2_grpc.TargetServiceStub(target_channel)
        draft = draft_pb2_grpc.DraftServiceStub(draft_channel)
        # Opened as a router does, which then dies: no call and no renewal follows.
        prefill = target_pb2.PrefillRequest(session_id="idle-one", token_ids=[1, 2, 3], capacity=128)
        target.Prefill(prefill, timeout=60)
        draft_prefill = draft_pb2.DraftPrefillRequest(
            session_id="idle-one",
            method="glide",
            token_ids=[1, 2, 3, 4],
            target_address=stack.address("target"),
            capacity=128,
        )
        draft.Prefill(draft_prefill, timeout=60)
        time.sleep(LEASE_SECONDS * 2.5)
        assert not target.Release(target_pb2.ReleaseRequest(session_id="idle-one"), timeout=10).released
        assert not draft.Release(draft_pb2.DraftReleaseRequest(session_id="idle-one"), timeout=10).released


def established_peers(port: int) -> set[str]:
    """The remote ends of the TCP connections established to this machine's `port`."""
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                peers.add(remote)
    return peers


def test_generations_reuse_the_tls_connections(stack, reference) -> None:
    """A TLS handshake costs a few milliseconds where a call on an open connection costs none more than
    plaintext: every hop (SDK to router, router to target and draft, the draft's KV feed) opens its
    connection once and keeps it, whatever the number of calls, rounds and generations."""
    ports = {role: stack.base_port + OFFSETS[role] for role in ("router", "target", "draft")}
    with client(stack) as c:
        c.generate(PROMPT, max_new_tokens=8, method="glide", timeout=300)
        before = {role: established_peers(port) for role, port in ports.items()}
        for _ in range(2):
            c.generate(PROMPT, max_new_tokens=8, method="glide", timeout=300)
        after = {role: established_peers(port) for role, port in ports.items()}
    assert all(before.values()), before
    assert after == before


def generate_while(stack: Stack, fault: Callable[[], None]) -> list[int]:
    """A greedy generation with `fault()` injected after its first tokens; never a quiet cancel."""
    tokens: list[int] = []
    with client(stack) as c:
        for chunk in c.stream(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, timeout=300):
            tokens += chunk.token_ids
            if fault is not None and tokens:
                fault()
                fault = None
            assert chunk.finish_reason != "cancelled"
    return tokens


@pytest.mark.parametrize("role", ["redis", "router", "target"])
def test_a_child_killed_mid_generation_is_restarted_and_the_output_is_unchanged(
    stack, reference, role
) -> None:
    others = {r: stack.child(r) for r in OFFSETS if r != role}
    victim = stack.child(role)
    tokens = generate_while(stack, lambda: os.kill(victim, signal.SIGKILL))
    assert tokens == reference
    stack.wait_for(rf"stack: {role} \(pid {victim}\) exited with code -9; the others keep serving", 30)
    stack.wait_for(rf"stack: {role} is serving again", 240)
    assert {r: stack.child(r) for r in others} == others  # nobody else was restarted
    if role == "redis":  # it came back with its password
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=stack.base_port + OFFSETS["redis"]).get("anything")


def test_a_dead_routers_sessions_are_released_by_their_lease(stack, reference) -> None:
    """A router killed mid-generation whose client does not resume: its target and draft sessions go
    once their lease lapses (seconds), not after the idle timeout (600 s here)."""
    tokens: list[int] = []
    router, killed = stack.child("router"), False
    with client(stack, retries=0) as c, pytest.raises(Unavailable):
        for chunk in c.stream(
            PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, method="glide", timeout=300
        ):
            tokens += chunk.token_ids
            if len(tokens) >= 4 and not killed:  # a few rounds in: the draft holds the session too
                os.kill(router, signal.SIGKILL)  # the stream then breaks: no retry resumes it
                killed = True
    assert stack.gauge("target", "specserve:target_sessions") >= 1  # abandoned, not released
    assert stack.gauge("draft", "specserve:draft_sessions") >= 1
    deadline = time.monotonic() + LEASE_SECONDS * 4
    while stack.gauge("target", "specserve:target_sessions") or stack.gauge(
        "draft", "specserve:draft_sessions"
    ):
        assert time.monotonic() < deadline, "the dead router's sessions are still held"
        time.sleep(0.5)
    stack.wait_for(rf"stack: router \(pid {router}\) exited with code -9", 30)
    stack.wait_for(r"stack: router is serving again", 240)
