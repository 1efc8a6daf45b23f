#!/usr/bin/env bash
# Type-checks specserve/ and services/ with mypy (settings in pyproject.toml, [tool.mypy]).
# Prints mypy's report, then the error count per file; exits non-zero while any error remains.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(.venv/bin/mypy "$@")
status=$?
echo "$out"
echo "$out" | grep -E '^[^:]+\.py:[0-9]+: error:' | cut -d: -f1 | sort | uniq -c | sort -rn
exit $status
