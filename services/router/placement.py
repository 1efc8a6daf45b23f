"""Choosing target and draft replicas: session affinity first, then the least loaded.

A session stays where its KV lives (its Redis record names the replica); a new or orphaned session goes
to the replica holding most of its prompt's prefix (prefix_routing.py) if that one is at most
`prefix_slack` sessions busier than the least loaded, else to the replica with the fewest sessions this
router has placed there, ties broken by a stable hash of the session id so that concurrent routers
spread the same way. A replica that failed recently is
skipped for `cooldown_seconds`.

Entries are `host:port` (one replica) or `dns:///host:port`: every address the name resolves to is a
replica `ip:port` (a Kubernetes headless Service lists its ready pods this way). Names are resolved
again every `refresh_seconds` and after a failure; a failed or empty lookup keeps the last good set.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence

from specserve.errors import Unavailable

DNS_SCHEME = "dns:///"

Resolver = Callable[[str, int], list[str]]  # (host, port) -> ["ip:port", ...]


def resolve_all(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = []
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        found.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return list(dict.fromkeys(found))


class ReplicaSet:
    def __init__(
        self,
        entries: Sequence[str],
        cooldown_seconds: float = 5.0,
        refresh_seconds: float = 5.0,
        resolver: Resolver = resolve_all,
        prefix_slack: int = 2,
    ) -> None:
        self.prefix_slack = prefix_slack
        if not entries:
            raise Unavailable("no replicas configured")
        self.entries = list(dict.fromkeys(entries))
        self.cooldown_seconds = cooldown_seconds
        self.refresh_seconds = refresh_seconds
        self.resolver = resolver
        self._load: Counter[str] = Counter()
        self._held: defaultdict[str, Counter[str]] = defaultdict(Counter)  # address -> session ids
        self._failed_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._resolved: dict[str, list[str]] = {}  # dns entry -> last non-empty resolution
        self._resolved_at = -1e9
        self.addresses: list[str] = []
        self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        """Caller holds the lock (or is the constructor)."""
        now = time.monotonic()
        if not force and now - self._resolved_at < self.refresh_seconds:
            return
        self._resolved_at = now
        addresses: list[str] = []
        for entry in self.entries:
            if not entry.startswith(DNS_SCHEME):
                addresses.append(entry)
                continue
            host, _, port = entry[len(DNS_SCHEME) :].rpartition(":")
            try:
                found = self.resolver(host, int(port))
            except (OSError, ValueError):
                found = []
            if found:
                self._resolved[entry] = found
            addresses += self._resolved.get(entry, [])
        self.addresses = list(dict.fromkeys(addresses))

    def choose(
        self, session_id: str, preferred: str = "", prefix_blocks: Mapping[str, int] | None = None
    ) -> str:
        """The replica for a session: `preferred` (affinity) if healthy, else the one holding most of
        its prompt's blocks (`prefix_blocks`, per address) within the slack, else the least loaded."""
        with self._lock:
            self._refresh()
            if not self.addresses:
                raise Unavailable(f"no replica resolved yet from {', '.join(self.entries)}")
            now = time.monotonic()
            healthy = [
                a for a in self.addresses if now - self._failed_at.get(a, -1e9) > self.cooldown_seconds
            ]
            if preferred in healthy:
                return preferred
            candidates = healthy or self.addresses  # all failed recently: try anyway
            least = min(candidates, key=lambda a: (self._load[a], _stable_hash(session_id, a)))
            if prefix_blocks:
                near = [
                    a
                    for a in candidates
                    if prefix_blocks.get(a, 0) > 0 and self._load[a] <= self._load[least] + self.prefix_slack
                ]
                if near:
                    return max(near, key=lambda a: (prefix_blocks[a], -self._load[a]))
            return least

    def acquire(self, address: str, session_id: str = "") -> None:
        """Counts a session on `address`; a named one is also listed in `sessions` (its lease there is
        renewed, leases.py)."""
        with self._lock:
            self._load[address] += 1
            if session_id:
                self._held[address][session_id] += 1

    def release(self, address: str, session_id: str = "") -> None:
        with self._lock:
            self._load[address] = max(0, self._load[address] - 1)
            held = self._held[address]
            if session_id and held[session_id] > 0:
                held[session_id] -= 1
                if held[session_id] == 0:
                    del held[session_id]

    def sessions(self) -> dict[str, list[str]]:
        """The named sessions held on each replica (replicas holding none are left out)."""
        with self._lock:
            return {address: sorted(held) for address, held in self._held.items() if held}

    def mark_failed(self, address: str) -> None:
        with self._lock:
            self._failed_at[address] = time.monotonic()
            self._resolved_at = -1e9  # look the names up again: the pod may have moved

    def load(self, address: str) -> int:
        return self._load[address]


class HeldReplica:
    """The replica one run of a session uses, counted in its set's load (and its lease renewed there)
    while held.

    Chosen once (the session's replica if healthy, else the least loaded). When a call to it fails,
    `move` marks it failed and takes the next choice, and the session's load moves with it: the counts
    always name the replicas sessions actually use.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        session_id: str,
        preferred: str = "",
        prefix_blocks: Mapping[str, int] | None = None,
    ) -> None:
        self.replicas, self.session_id = replicas, session_id
        self.address = replicas.choose(session_id, preferred, prefix_blocks)
        replicas.acquire(self.address, session_id)
        self._held = True

    def move(self) -> str:
        """The replica failed: the session goes to the next choice (the same one if nothing else is
        healthy). Returns the new address."""
        failed = self.address
        self.replicas.mark_failed(failed)
        self.address = self.replicas.choose(self.session_id)
        if self._held and self.address != failed:
            self.replicas.acquire(self.address, self.session_id)
            self.replicas.release(failed, self.session_id)
        return self.address

    def release(self) -> None:
        if self._held:
            self._held = False
            self.replicas.release(self.address, self.session_id)


def _stable_hash(session_id: str, address: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"{session_id}@{address}".encode(), digest_size=8).digest(), "little"
    )
