"""LocalStack's target replicas, without starting anything: the first replica keeps the single target's
name, port and log; the others take the ports after Redis's; the router and the draft are given every
replica; a fixed metrics or health port stays the first replica's."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.errors import InvalidArgument
from specserve.serving.stack import LocalStack, role_of


def test_one_target_is_the_stack_as_before(tmp_path: Path) -> None:
    stack = LocalStack(base_port=41000, log_dir=tmp_path)
    assert stack.ports == {"router": 41000, "target": 41001, "draft": 41002, "redis": 41003}
    assert stack.target_names == ("target",)
    assert stack.role_env("router")["SPECSERVE_ROUTER_TARGET_ADDRESSES"] == "localhost:41001"


def test_further_replicas_follow_redis_and_every_role_sees_them_all(tmp_path: Path) -> None:
    env = {"SPECSERVE_TARGET_METRICS_PORT": "9100", "SPECSERVE_TARGET_HEALTH_PORT": "9200"}
    stack = LocalStack(base_port=41000, log_dir=tmp_path, env=env, target_replicas=3)
    assert stack.target_names == ("target", "target-1", "target-2")
    assert [stack.ports[n] for n in ("router", "target", "draft", "redis")] == [41000, 41001, 41002, 41003]
    assert stack.target_addresses == ["localhost:41001", "localhost:41004", "localhost:41005"]
    everyone = ",".join(stack.target_addresses)
    assert stack.role_env("router")["SPECSERVE_ROUTER_TARGET_ADDRESSES"] == everyone
    assert stack.role_env("draft")["SPECSERVE_DRAFT_TARGET_ADDRESSES"] == everyone
    first, second = stack.role_env("target"), stack.role_env("target-2")
    assert (first["SPECSERVE_TARGET_PORT"], second["SPECSERVE_TARGET_PORT"]) == ("41001", "41005")
    assert (first["SPECSERVE_TARGET_METRICS_PORT"], first["SPECSERVE_TARGET_HEALTH_PORT"]) == ("9100", "9200")
    assert (second["SPECSERVE_TARGET_METRICS_PORT"], second["SPECSERVE_TARGET_HEALTH_PORT"]) == ("0", "0")
    assert role_of("target-2") == "target" and stack.names_of("target") == stack.target_names


def test_free_ports_are_distinct_and_a_replica_count_below_one_is_refused(tmp_path: Path) -> None:
    stack = LocalStack(log_dir=tmp_path, target_replicas=4)
    assert len(set(stack.ports.values())) == len(stack.ports) == 7
    with pytest.raises(InvalidArgument):
        LocalStack(log_dir=tmp_path, target_replicas=0)
