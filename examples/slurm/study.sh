#!/usr/bin/env bash
# The paper's study on a Slurm cluster in one command: a job array trains the arms (one arm
# per task, each --requeue), a report job that depends on the array (afterok) writes the same
# report as examples/reproduce_small.sh (tables, ablation decomposition, curves, frequency bars).
#
#   bash examples/slurm/study.sh                         six arms at laptop size (1 CPU node each)
#   ITERS=10 OUT=runs/study bash examples/slurm/study.sh --arms tied lev     a subset, shortened
#   bash examples/slurm/study.sh --size 1.2b --sbatch "--nodes 4 --gpus-per-node 8 --exclusive"
#
# Options: --size laptop|200m|400m|1.2b (laptop: reproduce_small.sh's tiny models; the others
# examples/recipes/pretrain.sh's), --arms ARM... (default all six), --sbatch "OPTIONS" (added to
# every training task's sbatch, e.g. nodes, GPUs, partition, --time); anything after `--` goes
# to reproduce_small.sh (laptop) or pretrain_leviathan.py (other sizes). Laptop size first runs
# a data job (corpus, tokenizer, datasets) the array depends on. Prints the job ids; logs in
# LOG_DIR (logs)/study-*.out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SIZE=laptop
ARMS=(tied untied albert flat-mlp factored-mlp lev)
EXTRA=""
FLAGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --size) SIZE="${2:?--size needs laptop, 200m, 400m or 1.2b}"; shift 2 ;;
        --arms) ARMS=(); shift; while [ $# -gt 0 ] && [[ "$1" != --* ]]; do ARMS+=("$1"); shift; done ;;
        --sbatch) EXTRA="${2:?--sbatch needs the options in one argument}"; shift 2 ;;
        --) shift; FLAGS=("$@"); break ;;
        *) echo "error: unknown option $1 (see the top of $0)" >&2; exit 2 ;;
    esac
done
case "$SIZE" in laptop | 200m | 400m | 1.2b) ;; *) echo "error: --size $SIZE: one of laptop, 200m, 400m, 1.2b" >&2; exit 2 ;; esac
for arm in "${ARMS[@]}"; do
    case "$arm" in tied | untied | albert | flat-mlp | factored-mlp | lev) ;;
        *) echo "error: --arms $arm: one of tied untied albert flat-mlp factored-mlp lev" >&2; exit 2 ;; esac
done
[ ${#ARMS[@]} -gt 0 ] || { echo "error: --arms needs at least one arm" >&2; exit 2; }
LIST=("${ARMS[@]}")
unset ARMS  # an array is not exported: the jobs get the arms as one string
export SIZE ARMS="${LIST[*]}" ROOT
LOG_DIR="${LOG_DIR:-$ROOT/logs}"
mkdir -p "$LOG_DIR"
SCRIPT="$ROOT/examples/slurm/study.sbatch"
OUTPUT="--output=$LOG_DIR/study-%j.out"
cd "$ROOT"
after=()
if [ "$SIZE" = laptop ]; then
    prep=$(sbatch --parsable --job-name=study-data "$OUTPUT" "$SCRIPT" prep "${FLAGS[@]}")
    after=(--dependency="afterok:$prep")
    echo "data job $prep"
fi
# shellcheck disable=SC2086  # EXTRA holds sbatch options
array=$(sbatch --parsable --job-name=study-train --array="0-$((${#LIST[@]} - 1))" --requeue \
    --signal=USR1@120 "${after[@]}" "--output=$LOG_DIR/study-%A_%a.out" $EXTRA "$SCRIPT" train "${FLAGS[@]}")
echo "training array $array: $(for i in "${!LIST[@]}"; do printf '%s_%s=%s ' "$array" "$i" "${LIST[$i]}"; done)"
report=$(sbatch --parsable --job-name=study-report --dependency="afterok:$array" "$OUTPUT" \
    "$SCRIPT" report "${FLAGS[@]}")
echo "report job $report (after the whole array succeeded)"
