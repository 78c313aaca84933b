#!/usr/bin/env bash
# Set up the environment if needed, then run the tests (CPU only).
#   bash scripts/test.sh                 the whole suite, both tiers, on 2 pytest-xdist workers
#                                        (TEST_WORKERS=N to change; 0 runs serially), then the
#                                        unit tier with the CPU accelerations off
#                                        (MEGATRON_EXT_CPU_ACCEL=0)
#   bash scripts/test.sh --fast          the unit tier only: no launched process, no training, no
#                                        test marked slow; on TEST_WORKERS workers too
#   bash scripts/test.sh tests/lev -k gradcheck    anything else goes to pytest as it is
# With workers (the first two forms), each runs its in-process tests on one thread (OMP_NUM_THREADS=1 unless set), as
# torchrun runs its ranks: two workers of two threads each on two cores spin-wait for each other
# (about a fifth more CPU time). OMP_NUM_THREADS=2 bash scripts/test.sh runs the suite with
# two-thread sums (another float32 rounding).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
# Slurm and munge for tests/slurm (a real single-host Slurm): installed when missing, as root
# with apt-get (about 25 s); otherwise those tests skip saying how to install them.
bash "$ROOT/scripts/install_slurm.sh"
cd "$ROOT"
WORKERS="${TEST_WORKERS:-2}"
if [ "$WORKERS" != "0" ] && [ "${1:-}" = "--fast" -o $# -eq 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
if [ "${1:-}" = "--fast" ]; then
    shift
    # --dist load: one module (tests/lev/test_lev_reference.py) holds half of this tier's time.
    exec "$PY" -m pytest -q -n "$WORKERS" --dist load -m "not integration and not slow" \
        "${@:-tests}"
fi
if [ $# -eq 0 ]; then
    "$PY" -m pytest -q -n "$WORKERS" tests
    # The unit tier again with the CPU accelerations off (megatron_ext/cpu_accel): the core's
    # portable paths on their own.
    MEGATRON_EXT_CPU_ACCEL=0 exec "$PY" -m pytest -q -n "$WORKERS" --dist load \
        -m "not integration and not slow" tests
fi
exec "$PY" -m pytest -q "$@"
