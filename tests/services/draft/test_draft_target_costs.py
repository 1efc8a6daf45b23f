"""A draft replica sizes trees by the costs its serving target publishes, not by its own host's.

Two real target services of the default model, in this process over real gRPC, each with a calibration of
its own: one where verifying a 64-node tree costs what one node does (wide trees pay), one where every node
beyond the root costs four one-token forwards (drafting never pays). One draft service, which holds no
target curve of its own, serves sessions on both: the cost method drafts wide trees for the first and the
root and at most one token for the second.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from router_like_session import RouterLikeSession

from services.draft.main import start_draft
from services.target.main import start_target
from specserve.serving.convert import costs_from_pb
from specserve.serving.server import RunningServer
from specserve.serving.settings import DraftServiceSettings, TargetServiceSettings
from specserve.settings import EngineSettings
from specserve.v1 import draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
METHOD = "glide-cape-cost"
# Published curves of a slow target (1 s a forward), so the draft's own measured step is small beside
# them and only the curve's shape decides the trees: flat, or each node costing four forwards.
FLAT = {"1": 1.0, "64": 1.01}
STEEP = {"1": 1.0, "2": 5.0, "64": 253.0}


def calibration(path: Path, verify_s: dict[str, float]) -> Path:
    path.write_text(json.dumps({"verify_s": verify_s}))
    return path


def serve_target(cache_dir: Path, costs: Path) -> RunningServer:
    settings = TargetServiceSettings(host="127.0.0.1", port=0, metrics_port=0)
    return start_target(settings, EngineSettings.from_env(cache_dir=cache_dir, calibration_path=costs))


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[dict[str, RunningServer]]:
    directory = tmp_path_factory.mktemp("target-costs")
    cache = EngineSettings.from_env().cache_dir  # the installed models; the calibrations are this test's
    flat = serve_target(cache, calibration(directory / "flat.json", FLAT))
    steep = serve_target(cache, calibration(directory / "steep.json", STEEP))
    targets = (f"127.0.0.1:{flat.port}", f"127.0.0.1:{steep.port}")
    draft_settings = DraftServiceSettings(host="127.0.0.1", port=0, metrics_port=0, target_addresses=targets)
    draft = start_draft(
        draft_settings, EngineSettings.from_env(cache_dir=cache, calibration_path=directory / "none.json")
    )
    running = {"flat": flat, "steep": steep, "draft": draft}
    yield running
    for server in running.values():
        server.stop(grace=0)


def stub(server: RunningServer, make):
    return make(grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def test_each_target_publishes_its_own_curve(services) -> None:
    for name, expected in (("flat", FLAT), ("steep", STEEP)):
        info = stub(services[name], target_pb2_grpc.TargetServiceStub).GetModelInfo(
            target_pb2.GetModelInfoRequest(), timeout=30
        )
        assert costs_from_pb(info.costs) == tuple((int(n), s) for n, s in expected.items())
        assert info.costs.version.startswith(info.model_name + "/cpu/float32/")


def test_the_draft_sizes_trees_by_the_serving_targets_costs(services) -> None:
    draft = stub(services["draft"], draft_pb2_grpc.DraftServiceStub)
    nodes = {}
    for name in ("flat", "steep"):
        target = stub(services[name], target_pb2_grpc.TargetServiceStub)
        address = f"127.0.0.1:{services[name].port}"
        session = RouterLikeSession(
            target, draft, address, f"costs-{name}", PROMPT_IDS, method=METHOD, seed=5
        )
        try:
            sizes = []
            for _ in range(3):
                response = session.propose(load=0, overhead_seconds=0.0)
                sizes.append(len(response.tree.token_ids))
                session.verify(response.tree)
            nodes[name] = sizes
        finally:
            session.release()
    assert min(nodes["flat"]) > 4, nodes  # wide trees where verification is flat
    assert max(nodes["steep"]) <= 2, nodes  # at most one drafted token where each costs four forwards
