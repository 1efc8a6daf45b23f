"""`specserve serve target`: the target service process."""

from __future__ import annotations

from services.model_service import ModelService, start_model_service
from services.target.servicer import TargetServicer
from specserve.runtime.target_runtime import TargetRuntime
from specserve.serving.metrics import TargetMetrics
from specserve.serving.server import RunningServer
from specserve.serving.settings import TargetServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import target_pb2, target_pb2_grpc


def _warm_up(models: TargetRuntime) -> None:
    models.target_runner  # load the model before reporting SERVING  # noqa: B018
    # The costs it publishes (GetModelInfo), which drafts size trees by: loaded, or measured once (~30 s
    # on 2 CPU cores, cached on disk) now rather than inside the first request.
    models.verify_points  # noqa: B018


def start_target(settings: TargetServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    role = ModelService(
        "target", target_pb2, target_pb2_grpc, TargetRuntime, TargetServicer, TargetMetrics.create, _warm_up
    )
    return start_model_service(role, settings, engine_settings)
