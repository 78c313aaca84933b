#!/usr/bin/env bash
# Paper recipe (docs/lev.md section 4): one arm at one scale, on one 8-GPU node or, under
# Slurm, on many (see examples/slurm/pretrain.sbatch, which sets LAUNCH).
#
#   bash examples/recipes/pretrain.sh SIZE ARM [VOCAB] [extra pretrain_leviathan.py flags]
#     SIZE   200m | 400m | 1.2b
#     ARM    tied | untied | albert | flat-mlp | factored-mlp | lev
#     VOCAB  o200k (default: the paper's tokenizer) | 50k | 100k | 200k (the vocabulary
#            ablation: SentencePiece BPE tokenizers trained on the Pile, see examples/README.md)
#
# Every arm gets the same hyper-parameters, seed, data order and token budget; only
# --embedding-type differs. The parallel layout (TP/PP/micro-batch) only changes how the same
# global batch is computed, never the math. Environment overrides:
#   DATA_DIR (data), TOKENIZER_DIR (tokenizers), RUNS_DIR (checkpoints/TensorBoard),
#   LAUNCH (default: torchrun --nproc-per-node $GPUS_PER_NODE), GPUS_PER_NODE (8),
#   TP, PP, MBS (per-size defaults below), SEED (1234).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SIZE="${1:?usage: pretrain.sh SIZE ARM [VOCAB] [flags...]}"
ARM="${2:?usage: pretrain.sh SIZE ARM [VOCAB] [flags...]}"
VOCAB="o200k"
if [ $# -ge 3 ] && [[ "$3" != --* ]]; then VOCAB="$3"; shift; fi
shift 2

DATA_DIR="${DATA_DIR:-data}"
TOKENIZER_DIR="${TOKENIZER_DIR:-tokenizers}"
RUNS_DIR="${RUNS_DIR:-runs}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
LAUNCH="${LAUNCH:-torchrun --nproc-per-node $GPUS_PER_NODE}"

# Shared by every arm and scale: sequence 512, batch 512 sequences (262,144 tokens per step),
# AdamW (0.9, 0.95), weight decay 0.1, clipping at 1.0, 1% warmup then cosine to 10% of the peak.
SEQ=512
GBS=512
# Token budget: ~20 tokens per TIED parameter (24.1B tokens at 1.2B, as the paper), in samples.
case "$SIZE" in
    200m) SAMPLES=7812500;  LR=6e-4; DEF_TP=1; DEF_MBS=16 ;;  #  4.0B tokens, 15,258 steps
    400m) SAMPLES=15625000; LR=3e-4; DEF_TP=1; DEF_MBS=16 ;;  #  8.0B tokens, 30,517 steps
    1.2b) SAMPLES=47070312; LR=2e-4; DEF_TP=1; DEF_MBS=16 ;;  # 24.1B tokens, 91,934 steps
    *) echo "unknown SIZE $SIZE (200m, 400m, 1.2b)" >&2; exit 2 ;;
esac
# Layouts for 80 GB GPUs from the memory planner (python tools/count_params.py --memory
# --scales 1.2b --vocab-sizes 200064 --data-parallel-size 8 --use-distributed-optimizer
# --seq-length 512 --micro-batch-size 16): the 1.2B model needs no tensor parallelism (32.4 GiB
# per GPU at TP=1, micro-batch 16, of which 6.1 GiB are the [8192, V] float32 logits; the
# loss's gradient of the same size comes on top in backward); micro-batch 32 would plan 52 GiB
# plus a 12 GiB gradient, too close to 80 GB. benchmarks/RESULTS.md has the planner against
# the measured memory of this model on CPU.
MIN_LR=$(python3 -c "print($LR / 10)")
TP="${TP:-$DEF_TP}"
PP="${PP:-1}"
MBS="${MBS:-$DEF_MBS}"
SP=()
[ "$TP" -gt 1 ] && SP=(--sequence-parallel)

case "$VOCAB" in
    o200k) TOK=(--tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER_DIR/o200k_base.tiktoken"
                --tiktoken-pattern o200k)
           DATA="$DATA_DIR/pile_o200k_text_document" ;;
    50k|100k|200k)
           TOK=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_DIR/pile_sp$VOCAB.model")
           DATA="$DATA_DIR/pile_sp${VOCAB}_text_document" ;;
    *) echo "unknown VOCAB $VOCAB (o200k, 50k, 100k, 200k)" >&2; exit 2 ;;
esac

NAME="${ARM}-${SIZE}-${VOCAB}"
cd "$ROOT"
# shellcheck disable=SC2086  # LAUNCH is a command line
exec $LAUNCH pretrain_leviathan.py \
    --model-size "$SIZE" --embedding-type "$ARM" --seq-length "$SEQ" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${SP[@]}" \
    --use-distributed-optimizer --bf16 \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-samples "$SAMPLES" \
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0 --seed "${SEED:-1234}" \
    --data-path "$DATA" --split 969,30,1 "${TOK[@]}" --num-workers 4 \
    --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 20 \
    --tensorboard-dir "$RUNS_DIR/$NAME/tensorboard" \
    --save "$RUNS_DIR/$NAME/ckpt" --load "$RUNS_DIR/$NAME/ckpt" --save-interval 1000 \
    --ckpt-keep-last 3 --exit-signal-handler \
    "$@"
