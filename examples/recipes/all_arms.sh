#!/usr/bin/env bash
# The six arms of the paper at one scale, one after another (same flags except the arm):
#   bash examples/recipes/all_arms.sh 400m [VOCAB] [extra flags]
# On a cluster submit them as separate jobs instead, e.g.
#   for arm in tied untied albert flat-mlp factored-mlp lev; do
#       sbatch examples/slurm/pretrain.sbatch 400m $arm; done
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SIZE="${1:?usage: all_arms.sh SIZE [VOCAB] [flags...]}"
shift
for arm in tied untied albert flat-mlp factored-mlp lev; do
    bash "$HERE/pretrain.sh" "$SIZE" "$arm" "$@"
done
