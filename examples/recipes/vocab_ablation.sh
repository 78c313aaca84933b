#!/usr/bin/env bash
# Vocabulary ablation (V = 50k, 100k, 200k): the same scale and recipe with SentencePiece BPE
# tokenizers of three sizes trained on the Pile (see examples/README.md for the data steps).
#   bash examples/recipes/vocab_ablation.sh [SIZE=400m] [ARMS="tied untied lev"] [extra flags]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SIZE="${1:-400m}"
ARMS="${2:-tied untied lev}"
shift $(( $# > 2 ? 2 : $# ))
for vocab in 50k 100k 200k; do
    for arm in $ARMS; do
        bash "$HERE/pretrain.sh" "$SIZE" "$arm" "$vocab" "$@"
    done
done
