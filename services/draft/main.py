"""`specserve serve draft`: the draft service process."""

from __future__ import annotations

from services.draft.servicer import DraftServicer
from services.model_service import ModelService, start_model_service
from specserve.runtime.models import ServedModels
from specserve.serving.metrics import DraftMetrics
from specserve.serving.server import RunningServer
from specserve.serving.settings import DraftServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import draft_pb2, draft_pb2_grpc


def _warm_up(models: ServedModels) -> None:
    models.glide_draft  # load the target's embedding and the draft before reporting SERVING  # noqa: B018
    # The default method's cost policy needs the machine's costs: load them, or measure them once (~30 s
    # on 2 CPU cores, cached on disk) now rather than inside the first request.
    models.cost_model  # noqa: B018


def start_draft(settings: DraftServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    role = ModelService("draft", draft_pb2, draft_pb2_grpc, DraftServicer, DraftMetrics.create, _warm_up)
    return start_model_service(role, settings, engine_settings)
