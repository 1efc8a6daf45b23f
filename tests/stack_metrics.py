"""Reading a local stack's Prometheus endpoints: each role given a free metrics port when it starts."""

from __future__ import annotations

import urllib.request

from specserve.serving.stack import LocalStack, free_port

ROLES = ("target", "draft", "router")


def metrics_env(ports: dict[str, int]) -> dict[str, str]:
    """The environment that serves each role's metrics on its port."""
    return {f"SPECSERVE_{role.upper()}_METRICS_PORT": str(port) for role, port in ports.items()}


def free_metrics_ports(roles: tuple[str, ...] = ROLES) -> dict[str, int]:
    return {role: free_port() for role in roles}


def metric(stack: LocalStack, role: str, name: str) -> float:
    """A sample's value from the role's Prometheus endpoint (summed over labels); the stack carries its
    ports as `metrics_ports`."""
    return metric_at(stack.metrics_ports[role], name)


def metric_at(port: int, name: str) -> float:
    """A sample's value from the Prometheus endpoint on `port` (summed over labels)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and " " in line]
    return sum(values)
