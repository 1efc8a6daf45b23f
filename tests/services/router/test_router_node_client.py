"""A non-Python client built from protos/ alone streams the same tokens as the Python SDK.

node_client/generate.js loads protos/specserve/v1/router.proto at run time (@grpc/proto-loader) and calls
RouterService.Generate with @grpc/grpc-js. Its npm dependencies (exact versions, package-lock.json) are
installed once per machine into ~/.cache/specserve/node_client/<hash of package.json + lock>/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from specserve.client import Client

pytestmark = [pytest.mark.distributed, pytest.mark.model]

CLIENT_DIR = Path(__file__).parent / "node_client"
PROTOS_DIR = Path(__file__).resolve().parents[3] / "protos"
PROMPT = "Give two tips for writing clear code."
MAX_NEW_TOKENS = 24


def node_modules() -> Path:
    """The client's node_modules, installed by `npm ci` once per package.json + lock content."""
    manifest = [CLIENT_DIR / "package.json", CLIENT_DIR / "package-lock.json"]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in manifest)).hexdigest()[:16]
    cache = Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
    installed = cache / "node_client" / digest
    if not (installed / "node_modules").is_dir():
        installed.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{digest}-", dir=installed.parent))
        for f in manifest:
            shutil.copy(f, staging)
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=staging,
            check=True,
            capture_output=True,
            timeout=300,
        )
        try:
            staging.rename(installed)  # atomic: a concurrent run either wins or finds it installed
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return installed / "node_modules"


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which("node") is None, reason="node (Node.js) is not installed: no non-Python client"
)
def test_node_client_streams_the_same_greedy_tokens_as_the_python_sdk(shared_stack):
    command = [
        "node",
        str(CLIENT_DIR / "generate.js"),
        "--address",
        shared_stack.router_address,
        "--protos",
        str(PROTOS_DIR),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--method",
        "glide-cape",
    ]
    env = dict(os.environ) | {"NODE_PATH": str(node_modules())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    from_node = json.loads(done.stdout)

    with Client(shared_stack.router_address) as client:
        from_python = client.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS, method="glide-cape")

    assert from_node["token_ids"] == from_python.token_ids
    assert len(from_node["token_ids"]) >= 1
    assert from_node["text"] == from_python.text
    expected_reason = {"length": "FINISH_REASON_LENGTH", "eos": "FINISH_REASON_EOS"}[
        from_python.finish_reason
    ]
    assert from_node["finish_reason"] == expected_reason
    assert from_node["session_id"] and from_node["session_id"] != from_python.session_id
    assert from_node["stats"]["num_generated_tokens"] == len(from_node["token_ids"])
