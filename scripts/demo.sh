#!/usr/bin/env bash
# The main job: set up if needed, start the local stack (Redis, target, draft and router processes), stream
# a real speculative generation through the client SDK, keep serving until Ctrl-C (ONCE=1: stop after it).
# The stack is secure by default: mutual TLS between the services from a fresh local CA, HTTPS and gRPC over
# TLS to the router, and a random API token it prints the file of (readable by you only), with commands
# that use it. INSECURE=1 serves plaintext without a token (a warning says so).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"Write a short Python function that checks whether a number is prime, and explain it."}
ARGS=(stack "$PROMPT" --max-new-tokens "${MAX_NEW_TOKENS:-128}")
if [ -n "${METHOD:-}" ]; then ARGS+=(--method "$METHOD"); fi  # else the model's default method
if [ "${ONCE:-0}" = "1" ]; then ARGS+=(--once); fi
if [ "${INSECURE:-0}" = "1" ]; then ARGS+=(--insecure); fi
# Fixed ports when serving on, so `specserve generate --remote localhost:50050` works from another shell
# and the OpenAI-compatible API (and the playground page) is at https://localhost:8000 (the stack prints
# the exact commands, with its CA and token file).
if [ "${ONCE:-0}" != "1" ]; then
  ARGS+=(--base-port "${BASE_PORT:-50050}" --http-port "${HTTP_PORT:-8000}")
else
  ARGS+=(--http-port 0)
fi
exec .venv/bin/specserve "${ARGS[@]}"
