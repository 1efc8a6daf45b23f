#!/usr/bin/env bash
# The test command (README, CI): set up from nothing, lint, type-check, run the suite.
#   bash scripts/test.sh                  the whole suite (what CI runs): the unit tier, then the integration
#                                         tier with the compute tier and the type check beside it
#   bash scripts/test.sh unit             the unit tier: `-m "not integration and not compute_only"`
#                                         (tests/conftest.py marks `integration`)
#   bash scripts/test.sh compute          the compute tier: `-m compute_only`, minutes of computation with no
#                                         clock, port or service in them (the sampling statistics, kernel
#                                         builds for other CPUs, the real model's outputs in process)
#   bash scripts/test.sh integration      the integration tier: services, processes, Ray, the browser
#   bash scripts/test.sh large-models     the tests of optional model profiles (`-m large_model`), which
#                                         the whole suite leaves out: CI never needs them, and where a
#                                         profile is installed they add minutes (a 1.5B model's stack)
# Further arguments go to pytest: bash scripts/test.sh unit -x tests/specserve/core
# The unit and compute tiers run one pytest-xdist worker per core, each with one torch thread: the tiny
# models' tests are mostly Python, which a second thread does not speed up. SPECSERVE_TEST_WORKERS sets
# the number of workers (0: in this process).
# The integration tier runs in one process: its tests share started services and the real model, and
# keep about one core busy, waiting on processes, services and sockets. The whole suite runs the compute
# tier and the type check beside it at idle CPU priority (SCHED_IDLE: they take a core only when the
# integration tier leaves it idle, so its services' timings stay its own).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all
needs_browser=1
case "${1:-}" in
  unit) tier=unit; needs_browser=0; shift ;;
  compute) tier=compute; needs_browser=0; shift ;;
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
  # worksteal: a worker that runs out takes tests queued on the other
  OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m "not integration and not compute_only" \
    -n "${SPECSERVE_TEST_WORKERS:-auto}" --dist worksteal "$@"
}
compute_tier() {
  OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m "compute_only and not large_model" \
    -n "${SPECSERVE_TEST_WORKERS:-auto}" --dist worksteal "$@"
}
integration_tier() {
  .venv/bin/python -m pytest -m "integration and not compute_only and not large_model" "$@"
}
# This shell, and what it starts from now on, at idle CPU priority (SCHED_IDLE), or at the lowest nice
# level where chrt cannot set it.
at_idle_priority() {
  chrt --idle --pid 0 "$BASHPID" >/dev/null 2>&1 || renice -n 19 -p "$BASHPID" >/dev/null
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
  compute)
    run_tier compute_tier "$@" || status=$?
    ;;
  integration)
    run_tier integration_tier "$@" || status=$?
    ;;
  all)
    run_tier unit_tier "$@" || status=$?
    # Beside the integration tier, at idle priority: the compute tier and the type check (mypy over
    # specserve/ and services/); their output follows the integration tier's, and a failure of any fails
    # the command.
    compute_log=$(mktemp)
    typecheck_log=$(mktemp)
    (at_idle_priority && run_tier compute_tier "$@") > "$compute_log" 2>&1 &
    compute_pid=$!
    (at_idle_priority && bash scripts/typecheck.sh) > "$typecheck_log" 2>&1 &
    typecheck_pid=$!
    run_tier integration_tier "$@" || status=$?
    if ! wait "$compute_pid"; then status=1; fi
    echo "---- the compute tier (run beside the integration tier)"
    cat "$compute_log"
    if ! wait "$typecheck_pid"; then
      cat "$typecheck_log"
      echo "test: the type check failed" >&2
      status=1
    fi
    rm -f "$compute_log" "$typecheck_log"
    ;;
esac
exit $status
