#!/usr/bin/env bash
# A single-host Slurm cluster for trying the sbatch examples: munged, slurmctld and two slurmd
# (two nodes) on this machine, everything (configuration, state, logs, munge key) in one
# directory.
#
#   bash scripts/slurm_local.sh start DIR    start it; then: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/slurm_local.sh stop DIR     cancel its jobs, stop the daemons, wait for them
#
# Needs Slurm and munge (Debian 12: apt-get install slurm-wlm munge, Slurm 22.05; or
# `bash scripts/install_slurm.sh`) and root (slurmd starts the jobs' processes). The two
# nodes are this machine, named by two of its loopback addresses, 127.0.0.1 and 127.0.0.2, each
# with all its CPUs: a job's `scontrol show hostnames` then gives addresses torchrun can reach,
# as host names are on a cluster (Slurm renames a node called `localhost` after the host, so
# that name cannot serve). Each node has its own slurmd (ports SLURMD_PORT and the next).
# SLURM_LOCAL_NODES=1 runs one node.
# Set for short time scales (tests/slurm/): time limits act at their minute (OverTimeLimit=0);
# slurmctld checks them every 30 s and sends a --signal warning at the first check that finds
# the end within the warning time plus 30 s (--time=1 --signal=USR1@10: 20 to 50 s after the
# start); SIGKILL follows SIGTERM after KillWait=5 s; a requeued job may start again 10 s after
# it ended (cred_expire); the scheduler looks at pending jobs every 2 s; an ended job's record
# stays an hour (MinJobAge), for `scontrol show job`.
# Ports: SLURMCTLD_PORT (6917), then SLURMD_PORT (6918) and the next for the second node.
set -euo pipefail
usage="usage: slurm_local.sh start|stop|status DIR"
CMD="${1:?$usage}"
DIR="${2:?$usage}"
GIVEN="$DIR"  # as the messages name it
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
export SLURM_CONF="$DIR/slurm.conf"

die() { echo "error: $*" >&2; exit 2; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# This cluster's munged, found by its socket (its pid file goes when its directory is removed).
munged_pids() { pgrep -f -- "--socket=$DIR/munge/munge.socket" || true; }

start() {
    for exe in munged slurmctld slurmd sbatch; do
        command -v "$exe" >/dev/null ||
            die "$exe not found: install Slurm and munge (apt-get install slurm-wlm munge, or bash scripts/install_slurm.sh)"
    done
    local nodes=(127.0.0.1)
    [ "${SLURM_LOCAL_NODES:-2}" -ge 2 ] && nodes+=(127.0.0.2)
    [ "$(id -u)" = 0 ] || die "slurmd must run as root (it starts the jobs as their users)"
    if alive "$DIR/slurmctld.pid" || [ -n "$(munged_pids)" ]; then
        die "a cluster already runs from $DIR (stop it first: bash scripts/slurm_local.sh stop $DIR)"
    fi
    # A start that fails half-way stops what it started.
    trap 'stop >/dev/null 2>&1' EXIT
    # slurmd's job sockets are DIR/spool-NODE/NODE_JOB.STEP, at most 107 characters.
    [ "${#DIR}" -le 60 ] ||
        die "$GIVEN is too long (${#DIR} characters, at most 60): slurmd's sockets under it would exceed Unix's 108; use a shorter directory"
    mkdir -p "$DIR/state" "$DIR/munge"
    chmod 700 "$DIR/munge"
    local cpus mem
    cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc obeys OMP_NUM_THREADS
    mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))
    # munge: a key of this cluster's own, its own socket (the system's munged is left alone).
    [ -f "$DIR/munge/munge.key" ] || head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    cat >"$SLURM_CONF" <<CONF
# Single-host Slurm written by scripts/slurm_local.sh
ClusterName=local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-6917}
SlurmdPort=${SLURMD_PORT:-6918}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
OverTimeLimit=0
InactiveLimit=0
MinJobAge=3600
MessageTimeout=10
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    local i=0 node
    for node in "${nodes[@]}"; do
        echo "NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1" \
            "Port=$((${SLURMD_PORT:-6918} + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN" \
            >>"$SLURM_CONF"
        mkdir -p "$DIR/spool-$node"
        i=$((i + 1))
    done
    slurmctld -i
    for node in "${nodes[@]}"; do slurmd -N "$node"; done
    for _ in $(seq 100); do
        if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "${#nodes[@]}" ]; then
            echo "slurm: cluster in $GIVEN up: nodes ${nodes[*]} ($cpus CPUs each);" \
                "its configuration: $GIVEN/slurm.conf (export SLURM_CONF)"
            trap - EXIT
            return 0
        fi
        sleep 0.2
    done
    sinfo >&2 || true
    tail -n 20 "$DIR"/slurmctld.log "$DIR"/slurmd-*.log >&2 || true
    die "the nodes did not come up within 20 s (logs above, in $DIR)"
}

stop() {
    if alive "$DIR/slurmctld.pid"; then
        # shellcheck disable=SC2046
        scancel --quiet $(squeue -h -o %A 2>/dev/null) 2>/dev/null || true
        for _ in $(seq 150); do
            [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    local pidfile pids=()
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
        alive "$pidfile" && pids+=("$(cat "$pidfile")")
    done
    # The Slurm daemons together (each takes about 2 s to exit), then munged, which they use
    # until they have exited.
    terminate "${pids[@]}"
    # shellcheck disable=SC2046
    terminate $(munged_pids)
    echo "slurm: cluster in $GIVEN stopped"
}

# SIGTERM to every pid given; SIGKILL to those still running 10 s later.
terminate() {
    local pid running
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 100); do
        running=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && running=1; done
        [ "$running" = 0 ] && return 0
        sleep 0.1
    done
    kill -KILL "$@" 2>/dev/null || true
}

case "$CMD" in
    start) start ;;
    stop) stop ;;
    status) sinfo; squeue ;;
    *) die "$usage" ;;
esac
