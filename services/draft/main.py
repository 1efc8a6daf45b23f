"""`specserve serve draft`: the draft service process."""

from __future__ import annotations

from services.draft.servicer import DraftServicer
from specserve.engine import Engine
from specserve.serving.metrics import DraftMetrics
from specserve.serving.model_thread import ModelThread
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import DraftServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specserve.v1.DraftService"


def start_draft(settings: DraftServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    model = ModelThread("draft-model")
    engine = model.run(_load, engine_settings)  # on the thread every later tensor op runs on
    metrics = DraftMetrics.create()
    servicer = DraftServicer(engine, settings, metrics, model)
    return start_server(
        settings,
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        (SERVICE_NAME,),
        metrics.registry,
        on_stop=servicer.close,
        release_session=lambda session_id: servicer.Release(
            draft_pb2.DraftReleaseRequest(session_id=session_id), None
        ),
    )


def _load(engine_settings: EngineSettings) -> Engine:
    engine = Engine(engine_settings)
    engine.glide_draft  # load the target's embedding and the draft before reporting SERVING  # noqa: B018
    # The default method's cost policy needs this machine's costs: load them, or measure them once (~30 s
    # on 2 CPU cores, cached on disk) now rather than inside the first request.
    engine.cost_model  # noqa: B018
    return engine
