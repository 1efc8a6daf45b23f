"""What every service process offers besides its API: grpc.health.v1, server reflection, and the
message-size limit (RESOURCE_EXHAUSTED above it), checked over real gRPC on the shared stack."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specserve.serving.settings import ServerSettings
from specserve.v1 import draft_pb2, draft_pb2_grpc, router_pb2, router_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

SERVICES = {
    "target": ("specserve.v1.TargetService", {"GetModelInfo", "Prefill", "Verify", "StreamKV", "Release"}),
    "draft": ("specserve.v1.DraftService", {"Prefill", "Propose", "Release"}),
    "router": ("specserve.v1.RouterService", {"Generate", "Resume", "Cancel", "ListMethods"}),
}
ROLES = list(SERVICES)
# Served beside their own API by the services that hold sessions: the router renews its sessions' leases.
SESSION_SERVICES = {
    "target": {"specserve.v1.SessionLeaseService"},
    "draft": {"specserve.v1.SessionLeaseService"},
}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("role", ROLES)
def test_health_reports_serving_for_the_server_and_its_service(channels, role):
    stub = health_pb2_grpc.HealthStub(channels[role])
    service_name, _ = SERVICES[role]
    for name in ("", service_name):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=30).status == SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Check(health_pb2.HealthCheckRequest(service="specserve.v1.NoSuchService"), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("role", ROLES)
def test_reflection_lists_and_describes_the_service(channels, role):
    database = ProtoReflectionDescriptorDatabase(channels[role])
    service_name, methods = SERVICES[role]
    assert set(database.get_services()) == {
        service_name,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        *SESSION_SERVICES.get(role, ()),
    }
    described = DescriptorPool(database).FindServiceByName(service_name)
    assert {m.name for m in described.methods} == methods


def oversized_call(channel: grpc.Channel, role: str) -> tuple[object, object]:
    """(stub method, request) of a request just above the default max message size."""
    too_big = "x" * (ServerSettings.max_message_bytes + 1024)
    if role == "target":
        stub = target_pb2_grpc.TargetServiceStub(channel)
        return stub.Prefill, target_pb2.PrefillRequest(session_id=too_big)
    if role == "draft":
        return draft_pb2_grpc.DraftServiceStub(channel).Propose, draft_pb2.ProposeRequest(session_id=too_big)
    return router_pb2_grpc.RouterServiceStub(channel).Generate, router_pb2.GenerateRequest(prompt=too_big)


@pytest.mark.parametrize("role", ROLES)
def test_a_message_above_the_size_limit_is_resource_exhausted(channels, expect_status, role):
    call, request = oversized_call(channels[role], role)
    details = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, call, request)
    assert "larger than max" in details
