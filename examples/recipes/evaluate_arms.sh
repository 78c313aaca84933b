#!/usr/bin/env bash
# The paper's evaluation of the arms trained by recipes/pretrain.sh at one scale: perplexity by
# token frequency (table and bars) and the loss curves with sample efficiency against TIED.
#   bash examples/recipes/evaluate_arms.sh SIZE [ARM...]          run it (default: all six arms)
#   bash examples/recipes/evaluate_arms.sh --print SIZE [ARM...]  print the commands only
# Outputs in eval/SIZE/frequency and eval/SIZE/curves. RUNS_DIR (runs) as recipes/pretrain.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PRINT=""
if [ "${1:-}" = --print ]; then PRINT=1; shift; fi
SIZE="${1:?usage: evaluate_arms.sh [--print] SIZE [ARM...]}"
shift
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(tied untied albert flat-mlp factored-mlp lev)
RUNS_DIR="${RUNS_DIR:-runs}"
LOADS="" RUNS=""
for arm in "${ARMS[@]}"; do
    LOADS+=" --load $RUNS_DIR/$arm-$SIZE-o200k/ckpt"
    RUNS+=" --run $arm=$RUNS_DIR/$arm-$SIZE-o200k/tensorboard"
done
BASE=tied
[[ " ${ARMS[*]} " == *" tied "* ]] || BASE="${ARMS[0]}"
COMMANDS=(
    "torchrun --nproc-per-node 2 tools/evaluate.py frequency$LOADS --names ${ARMS[*]} --baseline $BASE --split valid --tensor-model-parallel-size 2 --output-dir eval/$SIZE/frequency"
    "python tools/evaluate.py curves$RUNS --seq-length 512 --smoothing 0.6 --reference $BASE --output-dir eval/$SIZE/curves"
)
for cmd in "${COMMANDS[@]}"; do
    if [ -n "$PRINT" ]; then
        echo "  $cmd"
    else
        echo "+ $cmd"
        (cd "$ROOT" && $cmd)
    fi
done
