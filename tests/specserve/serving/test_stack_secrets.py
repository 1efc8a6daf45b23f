"""The local stack keeps its secrets off command lines, which every local user can read (`ps`,
/proc/<pid>/cmdline): Redis's password and the router's tokens reach real processes through 0600 files
and the environment only. Also: the stack removes its own temporary directory on a clean stop, keeps one
the caller named, and names its HTTPS URLs https.

The command lines are read by a scan of every process on the machine, as another user (`nobody`) when
the tests run as root (tests/specserve/serving/process_scan.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from process_scan import NOBODY, another_user, scan

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


# What another local user may do with a path (run as `nobody` when the tests run as root): each of
# read, write and enter-or-run, by os.access.
_ACCESS = """
import json, os, sys
print(json.dumps({p: [os.access(p, m) for m in (os.R_OK, os.W_OK, os.X_OK)] for p in json.load(sys.stdin)}))
"""


def others_access(paths: list[Path]) -> dict[str, list[bool]]:
    done = subprocess.run(
        [*another_user(), sys.executable, "-c", _ACCESS],
        input=json.dumps([str(p) for p in paths]),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.distributed
def test_a_log_directory_the_caller_names_is_made_private(tmp_path_factory) -> None:
    # Where another user can reach it (pytest's own base directory is 0700): a directory made with the
    # usual umask (0755) holding a log of an earlier run (0644).
    parent = Path(tempfile.mkdtemp(prefix="specserve-logs-"))
    try:
        parent.chmod(0o755)
        log_dir = parent / "logs"
        log_dir.mkdir(mode=0o755)
        log_dir.chmod(0o755)
        (log_dir / "router.log").write_text("session 0123456789abcdef\n")
        (log_dir / "router.log").chmod(0o644)
        with LocalStack(log_dir=log_dir, roles=("router",), tls=True, auth_tokens=(TOKEN,)) as stack:
            files = [p for p in log_dir.rglob("*") if p.is_file()]
            directories = [log_dir, *(p for p in log_dir.rglob("*") if p.is_dir())]
            assert {"router.log", "redis.log", "redis.conf", "api-tokens", "ca.crt"} <= {
                p.name for p in files
            }
            assert stack.tls_files and (log_dir / "tls").is_dir()
            assert {str(p): oct(mode(p)) for p in directories} == {str(p): "0o700" for p in directories}
            assert {str(p): oct(mode(p)) for p in files} == {str(p): "0o600" for p in files}
            if another_user():  # as another local user: nothing in it can be read, listed or entered
                seen = others_access([*directories, *files])
                assert seen == {str(p): [False, False, False] for p in [*directories, *files]}
        assert (log_dir / "router.log").exists()  # kept: the caller named it
    finally:
        shutil.rmtree(parent)


def test_a_log_directory_of_another_user_is_refused(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(InvalidArgument, match="owned by another user"):
        LocalStack(log_dir=theirs, roles=())
