"""Replica choice: affinity, least loaded, failure cooldown, and dns:/// expansion (what the Helm chart
renders for headless Services)."""

from __future__ import annotations

import pytest

from services.router.placement import HeldReplica, ReplicaSet
from specserve.errors import Unavailable


def test_affinity_wins_while_the_replica_is_healthy():
    replicas = ReplicaSet(["a:1", "b:1"])
    replicas.acquire("a:1")
    replicas.acquire("a:1")
    assert replicas.choose("s", preferred="a:1") == "a:1"  # busier, but the session's KV is there
    replicas.mark_failed("a:1")
    assert replicas.choose("s", preferred="a:1") == "b:1"


def test_new_sessions_go_to_the_least_loaded():
    replicas = ReplicaSet(["a:1", "b:1", "c:1"])
    for address in ("a:1", "a:1", "b:1"):
        replicas.acquire(address)
    assert replicas.choose("new") == "c:1"
    replicas.acquire("c:1")
    replicas.acquire("c:1")
    assert replicas.choose("new") == "b:1"
    replicas.release("a:1")
    replicas.release("a:1")
    assert replicas.choose("new") == "a:1"


def test_dns_entries_expand_to_every_resolved_address_and_keep_the_last_good_set():
    answers = {"pods": ["10.0.0.1:50051", "10.0.0.2:50051"]}

    def resolver(host: str, port: int) -> list[str]:
        assert port == 50051
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    replicas = ReplicaSet(["dns:///pods:50051", "fixed:7"], refresh_seconds=0.0, resolver=resolver)
    assert replicas.addresses == ["10.0.0.1:50051", "10.0.0.2:50051", "fixed:7"]
    answers["pods"] = ["10.0.0.3:50051"]  # scaled: one pod replaced
    replicas.choose("s")
    assert replicas.addresses == ["10.0.0.3:50051", "fixed:7"]
    del answers["pods"]  # the lookup fails: keep what we had
    replicas.choose("s")
    assert replicas.addresses == ["10.0.0.3:50051", "fixed:7"]


def test_unresolvable_names_fail_calls_not_startup():
    def resolver(host: str, port: int) -> list[str]:
        raise OSError("not yet")

    replicas = ReplicaSet(["dns:///pods:50051"], refresh_seconds=0.0, resolver=resolver)  # no raise
    with pytest.raises(Unavailable):
        replicas.choose("s")


def test_a_held_replica_counts_once_and_moves_its_load_with_the_session():
    replicas = ReplicaSet(["a:1", "b:1"])
    held = HeldReplica(replicas, "s", preferred="a:1")
    assert held.address == "a:1" and (replicas.load("a:1"), replicas.load("b:1")) == (1, 0)
    assert held.move() == "b:1"  # a failed: the session and its load go to b
    assert (replicas.load("a:1"), replicas.load("b:1")) == (0, 1)
    assert held.move() == "a:1"  # both failed recently: the least loaded again, and the load follows
    assert (replicas.load("a:1"), replicas.load("b:1")) == (1, 0)
    held.release()
    held.release()  # released once, whoever calls it again
    assert (replicas.load("a:1"), replicas.load("b:1")) == (0, 0)
