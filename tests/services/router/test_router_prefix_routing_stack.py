"""Prefix routing with two real target replicas (a LocalStack with `target_replicas=2`, no draft: the
`target` method needs none): a request that shares a prompt prefix of one whole block with a session
still running goes to that session's replica and takes the block from its cache, although the other
replica is idle; a router with prefix routing off sends the same pattern to the idle replica, cold.

The running session is what makes the replicas' loads differ: the router counts it on its replica until
it finishes, so the second request's placement sees one replica busy and the other idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pinned_costs import pinned_env
from router_process import router_env, router_process

from specserve.client import Client
from specserve.serving.stack import LocalStack

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(420)]

TIMEOUT = 120
CHUNK = 256  # the targets' prefill chunk: a replica caches whole chunks, or finer blocks
BUSY_TOKENS = 96  # long enough to still be generating while the second request is placed
MAX_TOKENS = 4


def document(name: str) -> str:
    """About 330 tokens that no other test sends: just over one chunk, so at least a chunk can be reused."""
    return " ".join(f"{name} log {i}: valve {i % 5} held {i * 7 % 13} bar." for i in range(22))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pinned_costs: Path) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("prefix-routing-stack")
    env = pinned_env(pinned_costs)  # what this tests is not the costs: none measured at start
    with LocalStack(log_dir=log_dir, roles=("target", "router"), target_replicas=2, env=env) as running:
        yield running


class Busy:
    """A long generation streamed on a thread; `last_chunk_at` says when it ended."""

    def __init__(self, client: Client, prompt: str) -> None:
        self.first_chunk = threading.Event()
        self.last_chunk_at = 0.0
        self.cached_tokens = -1
        self._stream = client.stream(
            prompt, method="target", max_new_tokens=BUSY_TOKENS, ignore_eos=True, timeout=TIMEOUT
        )
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        for chunk in self._stream:
            self.first_chunk.set()  # its prefill is done: the target cached its block
            self.last_chunk_at = time.monotonic()
            if chunk.stats:
                self.cached_tokens = int(chunk.stats["num_cached_tokens"])
        self.first_chunk.set()

    def join(self) -> None:
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "the busy generation did not finish"


def second_while_busy(address: str, name: str) -> tuple[int, Busy, float]:
    """Starts a long request over `name`'s document, and once its first token came, asks another
    question about the same document. Returns the second's cached tokens, the busy one and when the
    second was sent."""
    with Client(address) as client:
        busy = Busy(client, f"{document(name)}\n\nWhich valve held the most?")
        assert busy.first_chunk.wait(TIMEOUT)
        sent_at = time.monotonic()
        second = client.generate(
            f"{document(name)}\n\nHow many logs are there?", method="target", max_new_tokens=MAX_TOKENS
        )
        busy.join()
    return int(second.stats["num_cached_tokens"]), busy, sent_at


def test_a_shared_prefix_follows_its_replica_though_the_other_is_idle(stack: LocalStack) -> None:
    cached, busy, sent_at = second_while_busy(stack.router_address, "Pump")
    assert busy.last_chunk_at > sent_at, "the busy session ended before the second was placed"
    assert busy.cached_tokens == 0
    assert cached >= CHUNK  # the busier replica: the one holding the document's blocks


def test_without_prefix_routing_the_idle_replica_takes_it_cold(stack: LocalStack, tmp_path) -> None:
    env = router_env(stack, prefix_routing="false")
    with router_process(env, tmp_path / "router.log"):
        cached, busy, sent_at = second_while_busy(f"localhost:{env['SPECSERVE_ROUTER_PORT']}", "Boiler")
    assert busy.last_chunk_at > sent_at, "the busy session ended before the second was placed"
    assert cached == 0  # by load alone: the idle replica, which never saw the document
