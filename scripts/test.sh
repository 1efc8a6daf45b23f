#!/usr/bin/env bash
# The test command (README, CI): set up from nothing, lint, type-check, run the suite.
#   bash scripts/test.sh                  the whole suite (what CI runs)
#   bash scripts/test.sh unit             the unit tier: `-m "not integration"` (tests/conftest.py)
#   bash scripts/test.sh integration      the integration tier: real model, services, Ray, browser, processes
# Further arguments go to pytest: bash scripts/test.sh unit -x tests/specserve/core
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
needs_browser=1
case "${1:-}" in
  unit) tier=(-m "not integration"); needs_browser=0; shift ;;
  integration) tier=(-m integration); shift ;;
esac
# The playground's browser test (an integration test) drives Debian's Chromium through its chromedriver
# (Selenium cannot download a browser offline). Installed once, only when missing, beside the Python
# set-up: the two wait on different downloads, so together they take the time of the longer.
browser_pid=""
if [ "$needs_browser" = 1 ] && { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; }; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  (
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
  ) &
  browser_pid=$!
fi
bash scripts/setup.sh
if [ -n "$browser_pid" ]; then wait "$browser_pid"; fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The type check (mypy over specserve/ and services/, one core) runs beside the suite, whose many
# waits on starting services leave a core free; a failure of either fails the command.
typecheck_log=$(mktemp)
bash scripts/typecheck.sh > "$typecheck_log" 2>&1 &
typecheck_pid=$!
status=0
.venv/bin/python -m pytest "${tier[@]}" "$@" || status=$?
if ! wait "$typecheck_pid"; then
  cat "$typecheck_log"
  echo "test: the type check failed" >&2
  status=1
fi
rm -f "$typecheck_log"
exit $status
