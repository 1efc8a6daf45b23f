"""`specserve serve target`: the target service process."""

from __future__ import annotations

from services.target.servicer import TargetServicer
from specserve.engine import Engine
from specserve.serving.metrics import TargetMetrics
from specserve.serving.model_thread import ModelThread
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import TargetServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import target_pb2, target_pb2_grpc

SERVICE_NAME = "specserve.v1.TargetService"


def start_target(settings: TargetServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    model = ModelThread.for_settings("target-model", settings)
    engine = model.run(_load, engine_settings)  # on the thread every later tensor op runs on
    metrics = TargetMetrics.create()
    servicer = TargetServicer(engine, settings, metrics, model)
    return start_server(
        settings,
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        (SERVICE_NAME,),
        metrics.registry,
        on_stop=servicer.close,
        release_session=lambda session_id: servicer.Release(
            target_pb2.ReleaseRequest(session_id=session_id), None
        ),
    )


def _load(engine_settings: EngineSettings) -> Engine:
    engine = Engine(engine_settings)
    engine.target_runner  # load the model before reporting SERVING  # noqa: B018
    return engine
