"""`specserve serve target` and `specserve serve draft`: the two model services' one start-up path.

Each loads its models on its model thread (where every later tensor operation runs, see
specserve/serving/model_thread.py), warms up what its first request would wait for, then serves its
servicer with its metrics, idle-session release and a clean close. The gRPC service's name, its
registration function and its Release request come from the role's generated modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from specserve.serving.model_thread import ModelThread
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import ServerSettings
from specserve.settings import EngineSettings


@dataclass(frozen=True)
class ModelService:
    role: str  # "target" or "draft": names the model thread
    pb2: ModuleType  # the generated messages (one service per proto file)
    pb2_grpc: ModuleType  # the generated registration glue
    runtime: Callable[[EngineSettings], Any]  # the role's runtime: what it loads (runtime/*_runtime.py)
    servicer: Callable[..., Any]  # (runtime, settings, metrics, model thread) -> the servicer
    metrics: Callable[[], Any]  # -> the role's metrics (with a .registry)
    warm_up: Callable[[Any], object]  # loads, before SERVING, what the first request would wait for


def start_model_service(
    service: ModelService, settings: ServerSettings, engine_settings: EngineSettings
) -> RunningServer:
    (descriptor,) = service.pb2.DESCRIPTOR.services_by_name.values()
    add_to_server = getattr(service.pb2_grpc, f"add_{descriptor.name}Servicer_to_server")
    release_request = getattr(service.pb2, descriptor.methods_by_name["Release"].input_type.name)
    model = ModelThread.for_settings(f"{service.role}-model", settings)
    with model.alone():  # the warm-up measures what it publishes: no batching window in its forwards
        models = model.run(_load, service, engine_settings)
    metrics = service.metrics()
    servicer = service.servicer(models, settings, metrics, model)
    return start_server(
        settings,
        lambda server: add_to_server(servicer, server),
        (descriptor.full_name,),
        metrics.registry,
        on_stop=servicer.close,
        release_session=lambda session_id: servicer.Release(release_request(session_id=session_id), None),
    )


def _load(service: ModelService, engine_settings: EngineSettings) -> Any:
    runtime = service.runtime(engine_settings)
    service.warm_up(runtime)
    return runtime
