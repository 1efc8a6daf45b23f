"""Prefix-aware placement: a new session goes to the target replica this router sent most of its
prompt's leading blocks to, per tenant, unless that replica is busier than the least loaded by more than
the slack; affinity still wins."""

from __future__ import annotations

from services.router.placement import HeldReplica, ReplicaSet
from services.router.prefix_routing import PrefixDirectory, block_keys

BLOCK = 4
DOCUMENT = list(range(100, 113))  # 13 tokens: three whole blocks before the last token


def test_block_keys_name_whole_prefixes_per_tenant():
    keys = block_keys("alice", DOCUMENT, BLOCK)
    assert len(keys) == 3  # the last token is always computed by the target: never a reason to route
    assert block_keys("alice", [*DOCUMENT[:8], 1, 2, 3, 4, 5], BLOCK)[:2] == keys[:2]
    assert block_keys("alice", [*DOCUMENT[:8], 1, 2, 3, 4, 5], BLOCK)[2] != keys[2]
    assert block_keys("bob", DOCUMENT, BLOCK)[0] != keys[0]


def test_the_directory_counts_leading_blocks_per_replica_and_forgets_the_oldest():
    directory = PrefixDirectory(BLOCK, max_blocks=4)
    directory.record("a:1", "alice", DOCUMENT)
    directory.record("b:1", "alice", DOCUMENT[:6])
    assert directory.matched_blocks("alice", [*DOCUMENT, 9], ["a:1", "b:1", "c:1"]) == {
        "a:1": 3,
        "b:1": 1,
        "c:1": 0,
    }
    assert directory.matched_blocks("bob", [*DOCUMENT, 9], ["a:1"]) == {"a:1": 0}
    directory.record("a:1", "alice", [7] * 13)  # three more blocks on a: the document's first is forgotten
    assert directory.matched_blocks("alice", [*DOCUMENT, 9], ["a:1"]) == {"a:1": 0}


def test_a_new_session_follows_its_prefix_within_the_slack():
    replicas = ReplicaSet(["a:1", "b:1"], prefix_slack=2)
    replicas.acquire("a:1")
    replicas.acquire("a:1")
    assert replicas.choose("s", prefix_blocks={"a:1": 3, "b:1": 0}) == "a:1"  # 2 busier: within the slack
    replicas.acquire("a:1")
    assert replicas.choose("s", prefix_blocks={"a:1": 3, "b:1": 0}) == "b:1"  # 3 busier: by load
    assert replicas.choose("s", prefix_blocks={"a:1": 3, "b:1": 1}) == "b:1"
    assert replicas.choose("s", preferred="a:1", prefix_blocks={"b:1": 5}) == "a:1"  # affinity first
    replicas.mark_failed("a:1")
    assert replicas.choose("s", prefix_blocks={"a:1": 3}) == "b:1"  # never a failed replica


def test_held_replica_takes_the_prefix_choice():
    replicas = ReplicaSet(["a:1", "b:1"])
    held = HeldReplica(replicas, "s", prefix_blocks={"b:1": 2})
    assert held.address == "b:1" and replicas.load("b:1") == 1
    held.release()
