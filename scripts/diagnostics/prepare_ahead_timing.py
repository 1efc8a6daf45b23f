"""When, after a target commit, the KV-feed chunk and the router's Propose reach the draft, and how long
the draft takes to build a tree ahead of time and on request.

The numbers come from debug log lines that only the patch next to this script adds (they are not worth
a metric). docs/benchmarks.md (the distributed stack) quotes this:

    git apply scripts/diagnostics/prepare_ahead_timing.patch
    python scripts/diagnostics/prepare_ahead_timing.py /tmp/timing
    git apply -R scripts/diagnostics/prepare_ahead_timing.patch
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from specserve.client import Client
from specserve.serving.stack import LocalStack

PROMPTS = (
    "Explain what a hash table is.",
    "Write a haiku about autumn rain.",
    "What is 17 times 23? Show your steps.",
)
PROBES = {
    "chunk_lag": "commit -> chunk in the draft's mirror",
    "propose_lag": "commit -> Propose arrives at the draft",
    "prepare_ms": "building a tree ahead",
    "propose_ms": "Propose handler (waits for a build in progress)",
}


def main() -> None:
    log_dir = Path(sys.argv[1])
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"SPECSERVE_DRAFT_PREPARE_AHEAD": "true"}
    with LocalStack(log_dir=log_dir, env=env) as stack, Client(stack.router_address) as client:
        client.generate("warm up", max_new_tokens=8)
        for prompt in PROMPTS:
            client.generate(prompt, max_new_tokens=96, ignore_eos=True)
    text = (log_dir / "draft.log").read_text()
    if "PROBE" not in text:
        raise SystemExit("no PROBE lines in draft.log: apply the patch first (see the docstring)")
    for key, meaning in PROBES.items():
        values = [float(v) for v in re.findall(rf"PROBE {key}=([0-9.e-]+)", text)]
        if key == "propose_lag":  # the first Propose of a session comes before any commit it could follow
            values = [v for v in values if v < 60]
        print(f"{meaning:48s} median {1000 * statistics.median(values):6.2f} ms  (n={len(values)})")


if __name__ == "__main__":
    main()
