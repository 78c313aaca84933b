#!/usr/bin/env bash
# One GPU check, < 8 minutes on one H200: GPU correctness checks (Triton LEV kernel vs torch,
# TE spec vs local spec logits in BF16, FP8 steps, megatron engine vs portable engine over 20
# steps, the GPU pytest files), then 1.2B LEVIATHAN and TIED throughput (BF16, then FP8, at the
# largest micro-batch that fits): tokens/s, TFLOP/s per GPU, MFU, LEV/TIED step-time ratio.
# Everything lands in one JSON file (default: gpu_check.json); exit code 0 = all passed.
#
#   bash scripts/gpu_check.sh                        # on a GPU (e.g. in the NGC container)
#   bash scripts/gpu_check.sh --out results/h200.json --time-budget-s 420
#   bash scripts/gpu_check.sh --cpu-dry-run          # the CPU-runnable parts, tiny model
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# megatron-core's TP/SP overlap needs one CUDA stream of work at a time, as in Megatron-LM.
export CUDA_DEVICE_MAX_CONNECTIONS=1

for arg in "$@"; do
  if [[ "$arg" == "--cpu-dry-run" ]]; then
    # Triton's interpreter must be chosen before triton is imported.
    export TRITON_INTERPRET=1
    export CUDA_VISIBLE_DEVICES=""
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  fi
done

exec timeout --signal=TERM --kill-after=20 480 "$PYTHON" tools/gpu_check.py "$@"
