"""The router's process and the client SDK stay torch-free: their container images carry no torch.

Each import runs in a fresh interpreter, so modules this test process already loaded cannot hide one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # starts fresh interpreters

HEAVY = ("torch", "transformers")
CHECK = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "module",
    ["services.router.main", "services.router.servicer", "specserve.client", "specserve.app.serve"],
)
def test_import_leaves_torch_and_transformers_unloaded(module):
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(heavy=set(HEAVY)), module],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_the_check_sees_torch_when_it_is_imported():
    """The probe itself works: a module that does import torch is reported."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(heavy=set(HEAVY)), "specserve.engine"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert "torch" in json.loads(done.stdout)
