#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (CPU only, ~20 minutes on
# 2 cores). Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/lev -k gradcheck`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$PY" -m pytest -q "${@:-tests}"
