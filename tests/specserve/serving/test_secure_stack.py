"""A secure stack under faults: mutual TLS between the services (a local CA issued with `cryptography`),
bearer tokens at the router, Redis with a password and append-only persistence, and the stack
supervising its children. One stack for the module (the model loads once).

- tokens: no or a wrong token gets UNAUTHENTICATED with one fixed message; a session is bound to its
  creator (Resume and Cancel with another token get PERMISSION_DENIED);
- peers: the target and draft refuse plaintext and certificates of the wrong name; StreamKV is the
  draft's alone;
- faults: SIGKILL of Redis mid-generation (the supervisor restarts it from its append-only file) and
  of the router (restarted, the client resumes) both end token-identical to an undisturbed run;
- idle timeouts: target and draft sessions nobody drives are released.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis

from specserve.client import Client
from specserve.errors import PermissionDenied, Unauthenticated
from specserve.serving import tls
from specserve.serving.stack import LocalStack, wait_serving
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(600)]

TOKENS = ("token-alice", "token-bob")
IDLE_SECONDS = 4
PROMPT = "Count from one to thirty in words, separated by commas."
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    env = {
        "SPECSERVE_TARGET_SESSION_IDLE_SECONDS": str(IDLE_SECONDS),
        "SPECSERVE_DRAFT_SESSION_IDLE_SECONDS": str(IDLE_SECONDS),
        "SPECSERVE_ROUTER_REDIS_RETRY_SECONDS": "30",
    }
    log_dir = tmp_path_factory.mktemp("secure-stack")
    with LocalStack(log_dir=log_dir, env=env, tls=True, auth_tokens=TOKENS) as running:
        supervisor = threading.Thread(target=running.wait, daemon=True)
        supervisor.start()
        yield running
    supervisor.join(30)


def client(stack: LocalStack, token: str | None = TOKENS[0]) -> Client:
    files = stack.client_tls
    # Retries enough to outlast a router restart (the supervisor's backoff plus the router's start).
    return Client(stack.router_address, token=token, tls_ca_file=files.ca_file, retries=12)


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


def test_a_session_is_bound_to_its_creator(stack, reference) -> None:
    with client(stack) as alice:
        done = alice.generate(PROMPT, max_new_tokens=4, timeout=300)
    with client(stack, TOKENS[1]) as bob:
        with pytest.raises(PermissionDenied):
            list(bob.resume(done.session_id))
        with pytest.raises(PermissionDenied):
            bob.cancel(done.session_id)
    with client(stack) as alice:
        resumed = [t for chunk in alice.resume(done.session_id) for t in chunk.token_ids]
        assert resumed == done.token_ids
        alice.cancel(done.session_id)


def secure_channel(stack: LocalStack, files: tls.TlsFiles, role: str) -> grpc.Channel:
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
    with secure_channel(stack, stack.client_tls, "target") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The draft's certificate opens the KV feed only.
    with secure_channel(stack, stack.tls_files[tls.DRAFT_NAME], "target") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Release(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with secure_channel(stack, stack.tls_files[tls.ROUTER_NAME], "target") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert not stub.Release(request, timeout=10).released
        with pytest.raises(grpc.RpcError) as error:
            list(stub.StreamKV(target_pb2.StreamKVRequest(session_id="anyone"), timeout=10))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_idle_target_and_draft_sessions_are_released(stack, reference) -> None:
    router_files = stack.tls_files[tls.ROUTER_NAME]
    with (
        secure_channel(stack, router_files, "target") as target_channel,
        secure_channel(stack, router_files, "draft") as draft_channel,
    ):
        target = target_pb2_grpc.TargetServiceStub(target_channel)
        draft = draft_pb2_grpc.DraftServiceStub(draft_channel)
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
        time.sleep(IDLE_SECONDS * 2.5)
        assert not target.Release(target_pb2.ReleaseRequest(session_id="idle-one"), timeout=10).released
        assert not draft.Release(draft_pb2.DraftReleaseRequest(session_id="idle-one"), timeout=10).released


def kill(stack: LocalStack, role: str) -> int:
    """SIGKILL the child behind the stack's back, as a crash would; returns its pid."""
    pid = stack.processes[role].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def generate_while(stack: LocalStack, fault) -> list[int]:
    """A greedy generation with `fault()` injected after its first tokens."""
    tokens: list[int] = []
    with client(stack) as c:
        for chunk in c.stream(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, timeout=300):
            tokens += chunk.token_ids
            if fault is not None and tokens:
                fault()
                fault = None
            assert chunk.finish_reason != "cancelled"
    return tokens


def wait_restarted(stack: LocalStack, role: str, old_pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while stack.processes[role].pid == old_pid or stack.processes[role].poll() is not None:
        assert time.monotonic() < deadline, f"{role} was not restarted"
        time.sleep(0.2)


def test_redis_killed_mid_generation_is_restarted_and_the_output_is_unchanged(stack, reference) -> None:
    pids = {}
    tokens = generate_while(stack, lambda: pids.setdefault("redis", kill(stack, "redis")))
    assert tokens == reference
    wait_restarted(stack, "redis", pids["redis"])
    # It came back with its password, and with what it had persisted.
    assert redis.Redis.from_url(stack.redis_url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=stack.ports["redis"]).get("anything")


def test_router_killed_mid_generation_is_restarted_and_the_client_resumes(stack, reference) -> None:
    pids = {}
    tokens = generate_while(stack, lambda: pids.setdefault("router", kill(stack, "router")))
    assert tokens == reference
    wait_restarted(stack, "router", pids["router"])
    wait_serving(stack.router_address, 60, credentials=stack.channel_credentials())
    assert stack.restarts.get("router", 0) >= 1
    # The others kept serving: the same target and draft processes answer.
    with client(stack) as c:
        assert (
            c.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, timeout=300).token_ids == reference
        )
