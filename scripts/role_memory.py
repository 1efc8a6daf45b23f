"""Resident memory of each model service of the local stack after a generation, above an idle process
that imports the same code: what a draft replica costs against a target replica.

    .venv/bin/python scripts/role_memory.py [--model NAME] [--loads-only] [--json OUT]

Starts the local stack (`specserve stack`'s, insecure, on free ports), streams one generation through it
with the model's default method, then reads each service process's VmRSS; an idle process importing the
services' code gives the baseline. With --loads-only, each role is loaded in a fresh process as its
service loads it before SERVING (the target: its model, its cost curve not measured; the draft: its
warm-up), without a stack or a generation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from specserve.client import Client
from specserve.models.profiles import model_profile
from specserve.serving.stack import LocalStack

IMPORTS = """
import gc
import services.draft.main, services.target.main
from specserve.settings import EngineSettings
"""
RSS = """
gc.collect()
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")))
"""
LOADS = {
    "target": "from specserve.runtime.target_runtime import TargetRuntime\n"
    "runtime = TargetRuntime(EngineSettings.from_env())\nruntime.target_runner\n",
    "draft": "from specserve.runtime.draft_runtime import DraftRuntime\n"
    "runtime = DraftRuntime(EngineSettings.from_env())\nservices.draft.main.warm_up(runtime)\n",
}


def process_rss_mb(code: str, env: dict[str, str]) -> float:
    """VmRSS of a fresh process that ran `code` after the services' imports."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS + code + RSS],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model profile (default: the default model)")
    parser.add_argument("--loads-only", action="store_true", help="each role's load, without a stack")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    env = {} if args.model is None else {"SPECSERVE_MODEL": args.model}
    if args.model is not None:
        env["SPECSERVE_ROUTER_DEFAULT_METHOD"] = model_profile(args.model).default_method
    idle_mb = process_rss_mb("", env)
    if args.loads_only:
        memory = {role: process_rss_mb(code, env) for role, code in LOADS.items()}
    else:
        with tempfile.TemporaryDirectory() as logs, LocalStack(log_dir=Path(logs), env=env) as stack:
            with Client(stack.router_address) as client:
                client.generate("Explain what a hash table is.", max_new_tokens=32)
            memory = {role: rss_mb(stack.processes[role].pid) for role in ("target", "draft")}
    above = {role: mb - idle_mb for role, mb in memory.items()}
    record = {
        "model": args.model or "default",
        "measured": "role loads" if args.loads_only else "stack after a generation",
        "idle_mb": round(idle_mb),
        **{f"{role}_mb": round(mb) for role, mb in above.items()},
        "draft_over_target": round(above["draft"] / above["target"], 3),
    }
    print(json.dumps(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
