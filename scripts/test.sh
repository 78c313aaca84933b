#!/usr/bin/env bash
# Set up the environment if needed, then run the tests (CPU only).
#   bash scripts/test.sh                 the whole suite, both tiers, on 2 pytest-xdist workers
#                                        (TEST_WORKERS=N to change; 0 runs serially)
#   bash scripts/test.sh --fast          the unit tier only: no launched process, no training, no
#                                        test marked slow; on TEST_WORKERS workers too
#   bash scripts/test.sh tests/lev -k gradcheck    anything else goes to pytest as it is
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "${1:-}" = "--fast" ]; then
    shift
    # --dist load: one module (tests/lev/test_lev_reference.py) holds half of this tier's time.
    exec "$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist load -m "not integration and not slow" \
        "${@:-tests}"
fi
if [ $# -eq 0 ]; then
    exec "$PY" -m pytest -q -n "${TEST_WORKERS:-2}" tests
fi
exec "$PY" -m pytest -q "$@"
