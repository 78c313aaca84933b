#!/usr/bin/env bash
# A tiny Leviathan run on CPU in about a minute, no data preparation: Megatron-Core's mock GPT
# dataset, 2 gloo ranks at TP=2 with sequence parallelism, a checkpoint at iteration 20, then a
# resume of the same checkpoint at PP=2 (any TP/PP/DP layout loads any checkpoint).
# For the full path (corpus -> tokenizer -> indexed dataset -> training) see scripts/quickstart.sh.
#
#   bash examples/cpu_tiny.sh            # outputs in runs/cpu_tiny (OUT=... to change)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT="${OUT:-runs/cpu_tiny}"
rm -rf "$OUT"

ARGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
    --embedding-type lev --lev-num-heads 4 --lev-seed-dim 32 --lev-rank 8
    --micro-batch-size 4 --global-batch-size 16 --train-iters 40
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234
    --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-workers 0
    --log-interval 5 --eval-interval 20 --eval-iters 2
    --save "$OUT/ckpt" --save-interval 20 --tensorboard-dir "$OUT/tensorboard"
)

echo "=== iterations 1-20 at TP=2 + sequence parallel"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_leviathan.py \
    "${ARGS[@]}" --tensor-model-parallel-size 2 --sequence-parallel --exit-interval 20

echo "=== iterations 21-40 resumed at PP=2"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_leviathan.py \
    "${ARGS[@]}" --pipeline-model-parallel-size 2 --load "$OUT/ckpt"

echo "done: checkpoints in $OUT/ckpt, TensorBoard in $OUT/tensorboard (loss_curve.png inside)"
