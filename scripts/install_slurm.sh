#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, the client commands) and munge from the distribution's
# packages when they are missing: Debian 12 ships Slurm 22.05 as `slurm-wlm`. Only as root with
# apt-get; otherwise it says what to run and exits 0 (the Slurm tests then skip saying so).
# About 1 minute on a fresh Debian 12 machine (apt-get update included).
#   bash scripts/install_slurm.sh
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "[setup] Slurm is not installed (the Slurm tests will skip); install it with:" \
        "apt-get update && apt-get install -y slurm-wlm munge" >&2
    exit 0
fi
echo "[setup] installing Slurm and munge (apt-get install slurm-wlm munge)"
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "[setup] Slurm installed in $((SECONDS - start)) s"
