#!/usr/bin/env bash
# The paper's study at laptop scale: all six arms (TIED, UNTIED, ALBERT, FLAT-MLP, FACTORED-MLP,
# LEVIATHAN) with the same backbone (4 layers, hidden 128), hyper-parameters, seed, data order
# and token budget (ITERS x 16 x 128 tokens) on 2 CPU processes at TP=2, then the paper's tables
# and figures for that run in $OUT/report/report.md: final validation perplexity per arm with
# parameter counts, frequency-stratified table and bars, loss curves, sample efficiency of every
# arm against TIED (LEV vs TIED among them), and the ablation decomposition (continuous
# representation, compositional structure, spline smoothness).
#
#   bash examples/reproduce_small.sh                               # sample corpus
#   CORPUS=train.jsonl VALID=valid.jsonl bash examples/reproduce_small.sh   # your corpus
#   ITERS=10 OUT=runs/repro_short bash examples/reproduce_small.sh          # a shortened run
#
# Time: 48 minutes end to end on a shared 2-core CPU machine (2026-12-06, other jobs running
# beside it): about 7.5 minutes per arm (ITERS=600 x 16 x 128 = 1.2M tokens on an 8 MB sample
# corpus), then evaluation and the report; docs/quickstart.md shows that run's report.
# Like the quick start, finished stages are reused by a rerun (FRESH=1 starts over).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT="${OUT:-runs/reproduce_small}"
ARGS=(--out "$OUT" --iters "${ITERS:-600}" --corpus-mb 8 --arms tied untied albert flat-mlp factored-mlp lev
      --no-export --title "Laptop-scale reproduction: six arms")
if [ -n "${CORPUS:-}" ]; then ARGS+=(--corpus "$CORPUS" --valid-corpus "${VALID:?set VALID=valid.jsonl with CORPUS}"); fi
if [ -n "${FRESH:-}" ]; then ARGS+=(--fresh); fi
"$PY" tools/quickstart.py "${ARGS[@]}" "$@"
# A part of the study (--stages, as examples/slurm/study.sh's jobs run it) ends here.
[[ " $* " == *" --stages "* ]] && exit 0

echo
echo "The same study at the paper's scales (examples/README.md: 8 GPUs per run, the Pile with the"
echo "o200k tokenizer in data/, identical flags for every arm), then the same tables and figures"
echo "(on a Slurm cluster: bash examples/slurm/study.sh --size SIZE):"
for SIZE in 200m 400m 1.2b; do
    echo "  # $SIZE"
    echo "  for arm in tied untied albert flat-mlp factored-mlp lev; do bash examples/recipes/pretrain.sh $SIZE \$arm; done"
    bash examples/recipes/evaluate_arms.sh --print "$SIZE"
done
