#!/usr/bin/env bash
# The test command (README, CI): set up from nothing, lint, type-check, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The playground's browser test drives Debian's Chromium through its chromedriver (Selenium cannot
# download a browser offline). Installed once, only when missing.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh  # mypy over specserve/ and services/; fails on any error
exec .venv/bin/python -m pytest "$@"
