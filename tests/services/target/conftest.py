"""The shared stack's target, called directly over real gRPC (no router in between)."""

from __future__ import annotations

import pytest

from specserve.v1 import target_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def stub(channels) -> target_pb2_grpc.TargetServiceStub:
    return target_pb2_grpc.TargetServiceStub(channels["target"])


@pytest.fixture(scope="module")
def info(stub) -> target_pb2.ModelInfo:
    return stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=60)
