"""`specserve serve target`: the target service process."""

from __future__ import annotations

from services.model_service import ModelService, start_model_service
from services.target.servicer import TargetServicer
from specserve.runtime.models import ServedModels
from specserve.serving.metrics import TargetMetrics
from specserve.serving.server import RunningServer
from specserve.serving.settings import TargetServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import target_pb2, target_pb2_grpc


def _warm_up(models: ServedModels) -> None:
    models.target_runner  # load the model before reporting SERVING  # noqa: B018


def start_target(settings: TargetServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    role = ModelService("target", target_pb2, target_pb2_grpc, TargetServicer, TargetMetrics.create, _warm_up)
    return start_model_service(role, settings, engine_settings)
