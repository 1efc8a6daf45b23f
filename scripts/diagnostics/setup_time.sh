#!/usr/bin/env bash
# The set-up from nothing, timed for two revisions in turn: each round clones this repository at A, then
# at B, into a scratch directory and times `bash scripts/setup.sh` there (a new .venv each time; the
# package index's downloads are cached by pip, as on any machine that set up before).
#   bash scripts/diagnostics/setup_time.sh REV_A REV_B [ROUNDS]    (ROUNDS: 2 unless given)
# Prints one line per set-up: the revision, its seconds, the time of day it ended.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: setup_time.sh REV_A REV_B [ROUNDS]" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/../.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for _ in $(seq 1 "${3:-2}"); do
  for rev in "$1" "$2"; do
    rm -rf "$scratch/clone"
    git clone -q "$repo" "$scratch/clone"
    git -C "$scratch/clone" checkout -q "$rev"
    start=$(date +%s.%N)
    (cd "$scratch/clone" && bash scripts/setup.sh >/dev/null 2>&1)
    end=$(date +%s.%N)
    printf '%s %.1f s %s\n' "$rev" "$(echo "$end - $start" | bc)" "$(date -u +%T)"
  done
done
