#!/usr/bin/env bash
# The test command (README, CI): set up from nothing, lint, type-check, run the suite.
#   bash scripts/test.sh                  the whole suite (what CI runs): the unit tier, then the integration tier
#   bash scripts/test.sh unit             the unit tier: `-m "not integration"` (tests/conftest.py)
#   bash scripts/test.sh integration      the integration tier: real model, services, Ray, browser, processes
#   bash scripts/test.sh large-models     the tests of optional model profiles (`-m large_model`), which
#                                         the whole suite leaves out: CI never needs them, and where a
#                                         profile is installed they add minutes (a 1.5B model's stack)
# Further arguments go to pytest: bash scripts/test.sh unit -x tests/specserve/core
# The unit tier runs one pytest-xdist worker per core, each with one torch thread: the tiny models'
# tests are mostly Python, which a second thread does not speed up. SPECSERVE_TEST_WORKERS sets the
# number of workers (0: in this process).
# The integration tier runs in one process: its tests share started services and the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all
needs_browser=1
case "${1:-}" in
  unit) tier=unit; needs_browser=0; shift ;;
  integration) tier=integration; shift ;;
  large-models) tier=large-models; needs_browser=0; shift ;;
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
unit_tier() {
  # worksteal: a worker that runs out takes tests queued on the other (the statistical tests are long)
  OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m "not integration" -n "${SPECSERVE_TEST_WORKERS:-auto}" \
    --dist worksteal "$@"
}
integration_tier() {
  .venv/bin/python -m pytest -m "integration and not large_model" "$@"
}
# pytest's exit status 5 is "no test collected": arguments naming only one tier's tests leave the other
# tier empty, which is not a failure.
run_tier() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" = 5 ]; then rc=0; fi
  return "$rc"
}
status=0
case "$tier" in
  large-models)
    run_tier .venv/bin/python -m pytest -m large_model "$@" || status=$?
    ;;
  unit)
    run_tier unit_tier "$@" || status=$?
    bash scripts/typecheck.sh || status=1
    ;;
  integration | all)
    if [ "$tier" = all ]; then run_tier unit_tier "$@" || status=$?; fi
    # The type check (mypy over specserve/ and services/, one core) runs beside the integration tier,
    # whose many waits on starting services leave a core free; a failure of either fails the command.
    typecheck_log=$(mktemp)
    bash scripts/typecheck.sh > "$typecheck_log" 2>&1 &
    typecheck_pid=$!
    run_tier integration_tier "$@" || status=$?
    if ! wait "$typecheck_pid"; then
      cat "$typecheck_log"
      echo "test: the type check failed" >&2
      status=1
    fi
    rm -f "$typecheck_log"
    ;;
esac
exit $status
