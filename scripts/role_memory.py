"""Resident memory of each model service of the local stack after a generation, above an idle process
that imports the same code: what a draft replica costs against a target replica.

    .venv/bin/python scripts/role_memory.py [--model NAME] [--json OUT]

Starts the local stack (`specserve stack`'s, insecure, on free ports), streams one generation through it
with the model's default method, then reads each service process's VmRSS; an idle process importing the
services' code gives the baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from specserve.client import Client
from specserve.models.profiles import model_profile
from specserve.serving.stack import LocalStack

IDLE = """
import gc
import services.draft.main, services.target.main
gc.collect()
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")))
"""


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model profile (default: the default model)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    env = {} if args.model is None else {"SPECSERVE_MODEL": args.model}
    if args.model is not None:
        env["SPECSERVE_ROUTER_DEFAULT_METHOD"] = model_profile(args.model).default_method
    idle = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, check=True)
    idle_mb = int(idle.stdout) / 1024
    with tempfile.TemporaryDirectory() as logs, LocalStack(log_dir=Path(logs), env=env) as stack:
        with Client(stack.router_address) as client:
            client.generate("Explain what a hash table is.", max_new_tokens=32)
        memory = {role: rss_mb(stack.processes[role].pid) for role in ("target", "draft")}
    above = {role: mb - idle_mb for role, mb in memory.items()}
    record = {
        "model": args.model or "default",
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
