#!/usr/bin/env bash
# The main job on the embedded default: generate a small Pile-format corpus, train a SentencePiece
# tokenizer on it, preprocess it into Megatron indexed datasets, then train a tiny Leviathan model
# (LEV input embedding, untied head) on CPU with 2 gloo ranks at tensor-parallel size 2.
# Outputs go to runs/quickstart/ (override with OUT=...); data steps are reused when present.
# Extra arguments are passed to pretrain_leviathan.py (e.g. --embedding-type tied).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
OUT="${OUT:-runs/quickstart}"
NPROC="${NPROC:-2}"
mkdir -p "$OUT"

step() { echo; echo "=== $*"; }

if [ ! -f "$OUT/corpus/val.jsonl.zst" ]; then
    step "1/4 generating a sample corpus in $OUT/corpus"
    "$PY" tools/make_sample_corpus.py --output "$OUT/corpus" --size-mb 4 --seed 1234
fi
if [ ! -f "$OUT/tokenizer/sp4k.model" ]; then
    step "2/4 training a 4k SentencePiece BPE tokenizer"
    "$PY" tools/train_tokenizer.py --input "$OUT/corpus/train" --vocab-size 4096 \
        --model-prefix "$OUT/tokenizer/sp4k" --seed 1234
fi
TOK=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/sp4k.model")
for split in train val; do
    input="$OUT/corpus/train"; [ "$split" = val ] && input="$OUT/corpus/val.jsonl.zst"
    if [ ! -f "$OUT/data/${split}_text_document.idx" ]; then
        step "3/4 preprocessing the $split split into Megatron indexed datasets"
        "$PY" tools/preprocess_data.py --input "$input" --output-prefix "$OUT/data/$split" \
            "${TOK[@]}" --append-eod --workers 2
    fi
done

step "4/4 training a tiny Leviathan on CPU ($NPROC gloo ranks, TP=$NPROC)"
rm -rf "$OUT/ckpt" "$OUT/tensorboard"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_leviathan.py \
    --tensor-model-parallel-size "$NPROC" --sequence-parallel \
    --embedding-type lev --lev-num-heads 4 --lev-seed-dim 64 --lev-rank 16 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
    --train-data-path "$OUT/data/train_text_document" \
    --valid-data-path "$OUT/data/val_text_document" \
    "${TOK[@]}" \
    --log-interval 20 --eval-interval 100 --eval-iters 5 \
    --save "$OUT/ckpt" --save-interval 100 --tensorboard-dir "$OUT/tensorboard" \
    "$@"
echo
echo "done: checkpoints in $OUT/ckpt, TensorBoard logs in $OUT/tensorboard"
ls "$OUT"/ckpt/*.png "$OUT"/tensorboard/*.png 2>/dev/null || true
