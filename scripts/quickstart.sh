#!/usr/bin/env bash
# The whole product on CPU in under ten minutes, on the embedded default data: a sample corpus,
# a SentencePiece tokenizer, Megatron indexed datasets, a tiny LEVIATHAN and a tiny TIED model
# (same backbone, data order and token budget; 2 gloo ranks at TP=2), their evaluation
# (validation perplexity, frequency-stratified table), runs/quickstart/report/report.md with
# PNGs, and the Leviathan model exported to Hugging Face with a greedy continuation.
#
#   bash scripts/quickstart.sh                 # outputs in runs/quickstart (OUT=... to change)
#   bash scripts/quickstart.sh --iters 20      # a shortened run
#   bash scripts/quickstart.sh --fresh         # start over
#
# Stages that finished are reused by the next run; an interrupted or failed one is redone.
# Options are those of tools/quickstart.py (--help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$PY" tools/quickstart.py --out "${OUT:-runs/quickstart}" "$@"
