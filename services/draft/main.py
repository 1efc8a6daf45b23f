"""`specserve serve draft`: the draft service process. It loads a draft runtime (runtime/draft_runtime.py):
the drafts and the few target tensors they share, never a target layer."""

from __future__ import annotations

import torch

from services.draft.servicer import DraftServicer
from services.model_service import ModelService, start_model_service
from specserve.core.cost import NOMINAL_CPU_COST
from specserve.core.sampling_params import GREEDY
from specserve.methods import method_spec
from specserve.runtime.calibrate import SyntheticTargetState
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.serving.metrics import DraftMetrics
from specserve.serving.server import RunningServer
from specserve.serving.settings import DraftServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import draft_pb2, draft_pb2_grpc

WARM_UP_CAPACITY = 64


def warm_up(models: DraftRuntime) -> None:
    """Builds one drafter of the profile's default method before SERVING, so its draft is loaded and its
    step cost on this host measured (once, cached on disk) now rather than inside the first request. The
    drafter reads synthetic target state and is sized by a nominal curve: a session takes its target's."""
    settings = models.settings
    state = SyntheticTargetState(models.target_config, 1, settings.device, getattr(torch, settings.dtype))
    sources = models.for_target(NOMINAL_CPU_COST.verify_points)
    spec = method_spec(models.profile.default_method)
    drafter = spec.make_drafter(sources, WARM_UP_CAPACITY, state, GREEDY)
    if drafter is not None:
        drafter.release()


def start_draft(settings: DraftServiceSettings, engine_settings: EngineSettings) -> RunningServer:
    role = ModelService(
        "draft", draft_pb2, draft_pb2_grpc, DraftRuntime, DraftServicer, DraftMetrics.create, warm_up
    )
    return start_model_service(role, settings, engine_settings)
