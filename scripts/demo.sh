#!/usr/bin/env bash
# The main job: set up if needed, then a real speculative generation on the default model, streamed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"Write a short Python function that checks whether a number is prime, and explain it."}
exec .venv/bin/specserve generate "$PROMPT" --method "${METHOD:-glide}" --max-new-tokens "${MAX_NEW_TOKENS:-128}"
