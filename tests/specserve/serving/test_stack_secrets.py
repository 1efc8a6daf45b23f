"""The local stack keeps its secrets off command lines, which every local user can read (`ps`,
/proc/<pid>/cmdline): Redis's password and the router's tokens reach real processes through 0600 files
and the environment only. Also: the stack removes its own temporary directory on a clean stop, keeps one
the caller named, and names its HTTPS URLs https.

The command lines are read by a scan of every process on the machine, as another user (`nobody`) when
the tests run as root (tests/specserve/serving/process_scan.py).
"""

from __future__ import annotations

import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from process_scan import scan

from specserve.client import Client
from specserve.errors import InvalidArgument, Unauthenticated
from specserve.serving.stack import LocalStack

pytestmark = pytest.mark.timeout(300)

TOKEN = "stack-secret-" + secrets.token_urlsafe(24)


def assert_no_command_line_holds(stack: LocalStack, *secret_values: str) -> None:
    # The arguments each child was started with: what /proc shows (until a process such as Redis
    # rewrites its own title, which would hide a leak from the scan alone).
    for process in stack.processes.values():
        assert not [s for s in secret_values if any(s in str(arg) for arg in process.args)]
    found = scan(secret_values, [p.pid for p in stack.processes.values()])
    assert found.leaks == []
    # The scan saw the stack's own processes, so it looked where the secrets used to be.
    assert any("redis-server" in line for line in found.command_lines)
    if "router" in stack.processes:
        assert any("serve router" in line for line in found.command_lines)
    if found.as_another_user:  # the environment, which carries the Redis URL, is the owner's alone
        assert found.environ_readable == []


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("stack-secrets")
    with LocalStack(log_dir=log_dir, roles=("router",), tls=True, auth_tokens=(TOKEN,)) as running:
        yield running


@pytest.mark.distributed
def test_no_process_shows_the_redis_password_or_the_token(stack) -> None:
    assert stack.redis_password and stack.redis_password in stack.redis_url
    assert_no_command_line_holds(stack, stack.redis_password, TOKEN)


@pytest.mark.distributed
def test_secrets_sit_in_files_only_their_owner_reads(stack) -> None:
    assert mode(stack.log_dir / "redis.conf") == 0o600
    assert stack.redis_password in (stack.log_dir / "redis.conf").read_text()
    assert stack.token_file is not None and mode(stack.token_file) == 0o600
    assert stack.token_file.read_text().split() == [TOKEN]
    assert mode(stack.log_dir / "redis") == 0o700  # the append-only file: every session's prompt


@pytest.mark.distributed
def test_redis_and_the_router_use_those_secrets(stack) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=stack.ports["redis"]).get("anything")
    assert redis.Redis.from_url(stack.redis_url).ping()
    with Client(stack.router_address, **stack.client_options()) as client:  # the token from the file
        assert client.list_methods()
    no_token = {k: v for k, v in stack.client_options().items() if k != "token"}
    with Client(stack.router_address, **no_token) as client, pytest.raises(Unauthenticated):
        client.list_methods()


@pytest.mark.distributed
def test_a_restarted_redis_keeps_its_password_off_the_command_line(stack) -> None:
    stack.kill("redis")
    stack.start_redis()
    assert_no_command_line_holds(stack, stack.redis_password, TOKEN)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=stack.ports["redis"]).get("anything")


@pytest.mark.distributed
def test_a_stack_of_its_own_removes_its_directory_on_a_clean_stop() -> None:
    with LocalStack(roles=()) as stack:  # Redis alone: the directory holds its append-only file
        directory = stack.log_dir
        assert mode(directory) == 0o700 and (directory / "redis.conf").exists()
    assert not directory.exists()


@pytest.mark.distributed
def test_a_failed_stack_keeps_its_directory_and_says_where(capfd) -> None:
    with pytest.raises(RuntimeError), LocalStack(roles=()) as stack:
        directory = stack.log_dir
        raise RuntimeError("the demo failed")
    assert directory.exists() and f"stack: logs kept in {directory}" in capfd.readouterr().err
    shutil.rmtree(directory)


@pytest.mark.distributed
def test_a_directory_the_caller_names_is_kept(tmp_path) -> None:
    with LocalStack(log_dir=tmp_path / "logs", roles=()) as stack:
        assert stack.log_dir == tmp_path / "logs"
    assert (tmp_path / "logs" / "redis.log").exists()


def test_urls_of_a_tls_stack_are_https(tmp_path) -> None:
    stack = LocalStack(log_dir=tmp_path, tls=True, http_port=0)
    assert stack.http_url == f"https://localhost:{stack.http_port}/v1"
    assert stack.playground_url == f"https://localhost:{stack.http_port}/"
    plain = LocalStack(log_dir=tmp_path / "plain", http_port=0)
    assert plain.http_url == f"http://localhost:{plain.http_port}/v1"


@pytest.mark.parametrize("token", ["", "two words", "#comment", "line\nbreak"])
def test_tokens_a_token_file_cannot_hold_are_refused(tmp_path, token) -> None:
    with pytest.raises(InvalidArgument, match="token"):
        LocalStack(log_dir=tmp_path, auth_tokens=(token,))
