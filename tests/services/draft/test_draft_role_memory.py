"""A draft replica holds what it reads, never the target: no target decoder layer, no tensor equal to one of
the target's decoder weights, and a fraction of a target replica's memory.

Each role loads in a fresh process as its service does at start-up (the draft: its warm-up, then every
draft of the default model; the target: its model), beside an idle process importing the same code. The
costs are recorded (tests/pinned_costs.py), as on any host after a replica's first start: a first start
also measures its draft's step once, and what that leaves behind (about 14 MB here) depends on whether
an earlier test happened to record the costs, which is no property of a replica.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pinned_costs import pinned_env, write_pinned_costs

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

PRELUDE = """
import gc, json, torch
import services.draft.main, services.target.main
from specserve.settings import EngineSettings

def rss_mb():
    gc.collect()
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
"""

DRAFT = """
from services.draft.main import warm_up
from specserve.runtime.draft_runtime import DraftRuntime
runtime = DraftRuntime(EngineSettings.from_env())
warm_up(runtime)
# every trained draft of the default model (the early-exit draft of MCSD is the target's first layers)
loaded = [runtime.glide_draft, runtime.eagle_draft, runtime.vanilla_glide_draft]
rss = rss_mb()
modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
layers = [m for m in modules if type(m).__name__.endswith("DecoderLayer")]
from safetensors import safe_open
# dense tensors (a packed oneDNN weight is a draft's own, in a layout no checkpoint tensor has)
tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
held = [t for t in tensors if t.layout == torch.strided and not t.is_mkldnn]
equal = []
with safe_open(str(runtime.model_dir / "model.safetensors"), framework="pt") as weights:
    decoder_keys = [k for k in weights.keys() if ".layers." in k]
    for key in decoder_keys:
        weight = weights.get_tensor(key)
        equal += [key for t in held if t.shape == weight.shape and torch.equal(t.float(), weight.float())]
print(json.dumps({"rss": rss, "decoder_layers": len(layers), "equal": equal, "keys": len(decoder_keys)}))
"""

TARGET = """
from specserve.runtime.target_runtime import TargetRuntime
runtime = TargetRuntime(EngineSettings.from_env())
runtime.target_runner
print(json.dumps({"rss": rss_mb()}))
"""

IDLE = """
print(json.dumps({"rss": rss_mb()}))
"""


def run_together(codes: dict[str, str], weights: str, costs: Path) -> dict[str, dict]:
    """Runs each code in its own process, side by side (resident memory is each process's own, whatever
    runs beside it), and returns each one's last line of JSON by name."""
    env = {**os.environ, "SPECSERVE_WEIGHTS": weights, **pinned_env(costs)}
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", PRELUDE + code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, code in codes.items()
    }
    results = {}
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=500)
            assert process.returncode == 0, f"{name}: {err[-3000:]}"
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    return results


# A draft replica at most half a target's memory, on dense float32 weights and on the file's own (`auto`,
# the default on a CPU), where the target holds its 4-bit codes and the replica the embedding it shares in
# the file's codes too (runtime/target_share.py): measured 314 against 1,086 MB dense, 252 against 525 MB
# on the file's weights (0.48x; 317 against 565 MB, 0.56x, while the replica held a float32 table).
@pytest.mark.parametrize(("weights", "bound"), [("dense", 0.5), ("auto", 0.5)])
def test_a_draft_process_holds_no_target_decoder_layer_and_half_a_targets_memory(
    default_model_dir, tmp_path: Path, weights: str, bound: float
) -> None:
    costs = write_pinned_costs(tmp_path / "costs.json")
    ran = run_together({"draft": DRAFT, "idle": IDLE, "target": TARGET}, weights, costs)
    draft, idle, target = ran["draft"], ran["idle"], ran["target"]
    assert draft["decoder_layers"] == 0
    assert draft["keys"] > 0 and draft["equal"] == []  # not one target decoder weight, by value
    draft_mb, target_mb = draft["rss"] - idle["rss"], target["rss"] - idle["rss"]
    print(f"{weights}, above an idle process: draft {draft_mb:.0f} MB, target {target_mb:.0f} MB")
    assert draft_mb <= bound * target_mb, (draft_mb, target_mb)
