"""The command-line flags of Megatron-LM core_v0.16.1 that `pretrain_leviathan.py` must know:
(argument group, flag, kind) for every flag its `megatron/training/arguments.py` registers in the
named groups, extracted once from its parser (the LLaMA-3 8B and GPT-3 175B example scripts'
flags among them); kind "switch" (no value), "value" (one) or "list" (one or more).
`megatron_compat` answers each.
"""

from __future__ import annotations

MEGATRON_LM_VERSION = "core_v0.16.1"

# (argument group) -> its flags in Megatron-LM's order: --x a switch, --x=V one value, --x=V+ one
# or more.
_GROUPS = {
    "network size": """
        --encoder-num-layers=V --decoder-num-layers=V --group-query-attention --window-size=V
        --window-attn-skip-freq=V --max-position-embeddings=V --position-embedding-type=V
        --relative-attention-num-buckets=V --relative-attention-max-distance=V
        --use-rotary-position-embeddings --rotary-base=V --rotary-percent=V
        --rotary-seq-len-interpolation-factor=V --use-rope-scaling --rope-scaling-factor=V
        --no-rope-freq=V --no-position-embedding --make-vocab-size-divisible-by=V --openai-gelu
        --squared-relu --swiglu --quick-geglu --onnx-safe=V --bert-no-binary-head
        --untie-embeddings-and-output-weights
    """,
    "transformer configuration": """
        --tensor-model-parallel-size=V --pipeline-model-parallel-comm-backend=V
        --pipeline-model-parallel-size=V --sequence-parallel --context-parallel-size=V
        --hierarchical-context-parallel-sizes=V+ --max-seqlen-per-dp-cp-rank=V
        --hybrid-context-parallel --expert-model-parallel-size=V --expert-tensor-parallel-size=V
        --moe-extended-tp --no-initialization --use-cpu-initialization --fp16 --bf16
        --deterministic-mode --no-async-tensor-model-parallel-allreduce
        --disable-async-tensor-model-parallel-allreduce --tp-comm-overlap --no-tp-comm-bulk-wgrad
        --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad
        --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs
        --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag
        --disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs
        --cross-entropy-loss-fusion --cross-entropy-fusion-impl=V --tp-comm-bootstrap-backend=V
        --overlap-moe-expert-parallel-comm --delay-wgrad-compute
        --ep-overlap-early-attn-memory-release --use-ring-exchange-p2p
        --defer-embedding-wgrad-compute --wgrad-deferral-limit=V
        --overlap-p2p-communication-warmup-flush
        --microbatch-group-size-per-virtual-pipeline-stage=V --mtp-standalone
        --cpu-offloading-num-layers=V --num-layers=V --mtp-num-layers=V --mtp-loss-scaling-factor=V
        --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
        --hidden-size=V --num-attention-heads=V --attention-backend=V --softmax-type=V
        --num-query-groups=V --ffn-hidden-size=V --kv-channels=V --hidden-dropout=V
        --attention-dropout=V --fp32-residual-connection --apply-residual-connection-post-layernorm
        --norm-epsilon=V --apply-layernorm-1p --disable-bias-linear --add-qkv-bias
        --glu-linear-offset=V --activation-func-clamp-value=V --rotary-interleaved --normalization=V
        --qk-layernorm --qk-l2-norm --qk-clip --qk-clip-alpha=V --qk-clip-threshold=V
        --attention-output-gate --calculate-per-token-loss --multi-latent-attention
        --experimental-attention-variant=V --dsa-indexer-n-heads=V --dsa-indexer-head-dim=V
        --dsa-indexer-topk=V --dsa-indexer-loss-coeff=V --dsa-indexer-use-sparse-loss
        --linear-conv-kernel-dim=V --linear-key-head-dim=V --linear-value-head-dim=V
        --linear-num-key-heads=V --linear-num-value-heads=V --init-method-std=V
        --embedding-init-method-std=V --init-model-with-meta-device --apply-query-key-layer-scaling
        --disable-bf16-reduced-precision-matmul --use-fused-weighted-squared-relu
        --recompute-granularity=V --recompute-method=V --recompute-num-layers=V
        --distribute-saved-activations --recompute-modules=V+ --fp8-format=V --fp8-recipe=V
        --fp8-quantizer-factory=V --fp8-margin=V --fp8-interval=V --fp8-amax-history-len=V
        --fp8-amax-compute-algo=V --no-fp8-wgrad --disable-fp8-wgrad --first-last-layers-bf16
        --num-layers-at-start-in-bf16=V --num-layers-at-end-in-bf16=V --use-kitchen-attention
        --kitchen-attention-backend=V --fp4-format=V --fp4-recipe=V --fp4-param-gather
        --fp4-quantizer-factory=V --moe-shared-expert-intermediate-size=V --moe-shared-expert-gate
        --moe-shared-expert-overlap --moe-ffn-hidden-size=V --moe-router-topk=V
        --moe-enable-routing-replay --moe-router-padding-for-quantization
        --moe-router-padding-for-fp8 --moe-router-num-groups=V --moe-router-group-topk=V
        --moe-router-pre-softmax --moe-router-topk-scaling-factor=V --moe-router-score-function=V
        --moe-router-dtype=V --moe-router-enable-expert-bias --moe-router-bias-update-rate=V
        --moe-router-force-load-balancing --moe-grouped-gemm --moe-use-legacy-grouped-gemm
        --moe-z-loss-coeff=V --moe-input-jitter-eps=V --moe-token-dispatcher-type=V
        --moe-enable-deepep --moe-flex-dispatcher-backend=V --moe-per-layer-logging
        --moe-expert-capacity-factor=V --moe-pad-expert-input-to-capacity --moe-token-drop-policy=V
        --moe-layer-recompute --moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input
        --moe-latent-size=V --moe-deepep-num-sms=V --moe-hybridep-num-sms=V --enable-cuda-graph
        --cuda-graph-warmup-steps=V --external-cuda-graph --cuda-graph-impl=V
        --no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding
        --config-logger-dir=V --flash-decode --batch-invariant-mode --use-te-activation-func
        --symmetric-ar-type=V --inference-fuse-tp-communication --mrope-section=V+ --is-hybrid-model
        --mamba-state-dim=V --mamba-head-dim=V --mamba-num-groups=V --mamba-num-heads=V
        --disable-mamba-mem-eff-path --mlp-chunks-for-prefill=V --transformer-impl=V
        --fine-grained-activation-offloading --offload-modules=V+ --min-offloaded-tensor-size=V
    """,
    "regularization": """
        --weight-decay=V --apply-wd-to-qk-layernorm --clip-grad=V --adam-beta1=V --adam-beta2=V
        --adam-eps=V --sgd-momentum=V --muon-momentum=V --muon-no-split-qkv --muon-use-nesterov
        --muon-scale-mode=V --muon-fp32-matmul-prec=V --muon-num-ns-steps=V --muon-tp-mode=V
        --muon-extra-scale-factor=V --no-weight-decay-cond-type=V
    """,
    "training": """
        --micro-batch-size=V --global-batch-size=V --rampup-batch-size=V
        --decrease-batch-size-if-needed --empty-unused-memory-level=V
        --check-weight-hash-across-dp-replicas-interval=V --train-sync-interval=V --train-iters=V
        --train-samples=V --exit-interval=V --exit-duration-in-mins=V --exit-signal-handler
        --exit-signal=V --exit-signal-handler-for-dataloader --manual-gc --manual-gc-interval=V
        --no-manual-gc-eval --disable-manual-gc-eval --iterations-to-skip=V+ --batch-size=V
        --recompute-activations --no-check-for-nan-in-loss-and-grad --check-for-large-grads
        --result-rejected-tracker-filename=V --disable-gloo-process-groups --tp-comm-overlap-cfg=V
        --checkpoint-activations --no-masked-softmax-fusion --no-bias-gelu-fusion
        --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --rope-type=V
        --use-flash-attn --optimizer=V --optimizer-cpu-offload --optimizer-offload-fraction=V
        --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d
        --dump-param-to-param-group-map=V --no-pin-cpu-grads --no-pin-cpu-params --dataloader-type=V
        --no-persist-layer-norm --no-gradient-accumulation-fusion --use-mcore-models
        --use-legacy-models --high-priority-stream-groups=V+ --disable-jit-fuser
    """,
    "profiling": """
        --profile --profile-step-start=V --profile-step-end=V --use-pytorch-profiler
        --profile-ranks=V+ --record-memory-history --memory-snapshot-path=V
    """,
    "RNG and initialization": """
        --seed=V --te-rng-tracker --inference-rng-tracker --data-parallel-random-init
        --init-method-xavier-uniform
    """,
    "learning rate and weight decay": """
        --lr-decay-style=V --lr-wsd-decay-style=V --lr-decay-iters=V --lr-decay-samples=V
        --lr-wsd-decay-iters=V --lr-wsd-decay-samples=V --lr-warmup-fraction=V --lr-warmup-iters=V
        --lr-warmup-samples=V --lr-warmup-init=V --override-opt_param-scheduler
        --override-opt-param-scheduler --use-checkpoint-opt_param-scheduler
        --use-checkpoint-opt-param-scheduler --start-weight-decay=V --end-weight-decay=V
        --weight-decay-incr-style=V --lr=V --warmup=V --min-lr=V --decoupled-lr=V
        --decoupled-min-lr=V
    """,
    "checkpointing": """
        --save=V --save-interval=V --persistent-save-interval=V --save-wgrads-interval=V
        --save-dgrads-interval=V --save-retain-interval=V --load=V --load-main-params-from-ckpt
        --non-persistent-save-interval=V --non-persistent-ckpt-type=V
        --non-persistent-global-ckpt-dir=V --non-persistent-local-ckpt-dir=V
        --non-persistent-local-ckpt-algo=V --finetune --pretrained-checkpoint=V --ckpt-step=V
        --use-checkpoint-args --use-mp-args-from-checkpoint-args
        --no-use-tokenizer-model-from-checkpoint-args
        --disable-use-tokenizer-model-from-checkpoint-args --exit-on-missing-checkpoint
        --ckpt-format=V --auto-detect-ckpt-format --ckpt-convert-format=V --ckpt-convert-save=V
        --ckpt-convert-update-legacy-dist-opt-format --no-ckpt-fully-parallel-save
        --disable-ckpt-fully-parallel-save --async-save --use-persistent-ckpt-worker
        --ckpt-fully-parallel-load --ckpt-assume-constant-structure --no-strict-fsdp-dtensor-load
        --disable-strict-fsdp-dtensor-load --dist-ckpt-strictness=V --dist-ckpt-save-pre-mcore-014
        --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
        --replication --replication-jump=V --replication-factor=V --no-save-optim --no-save-rng
        --no-load-optim --no-load-rng --use-dist-ckpt --dist-ckpt-format=V
        --ckpt-fully-parallel-save
    """,
    "mixed precision": """
        --grad-reduce-in-bf16 --loss-scale=V --initial-loss-scale=V --min-loss-scale=V
        --loss-scale-window=V --hysteresis=V --attention-softmax-in-fp32
        --accumulate-allreduce-grads-in-fp32 --fp16-lm-cross-entropy
        --reuse-grad-buf-for-mxfp8-param-ag
    """,
    "distributed": """
        --decoder-first-pipeline-num-layers=V --decoder-last-pipeline-num-layers=V
        --pipeline-model-parallel-layout=V --model-parallel-size=V
        --num-layers-per-virtual-pipeline-stage=V --num-virtual-stages-per-pipeline-rank=V
        --no-overlap-p2p-communication --distributed-backend=V --distributed-timeout-minutes=V
        --distributed-timeout-seconds-after-init=V --overlap-grad-reduce --no-align-grad-reduce
        --ddp-num-buckets=V --ddp-bucket-size=V --ddp-pad-buckets-for-high-nccl-busbw
        --ddp-reduce-scatter-with-fp32-accumulation --ddp-average-in-collective
        --overlap-param-gather --overlap-param-gather-with-optimizer-step --no-align-param-gather
        --no-scatter-gather-tensors-in-pipeline --local-rank=V --lazy-mpu-init=V
        --use-distributed-optimizer --use-nccl-ub --disable-symmetric-registration
        --fsdp-manual-registration --use-sharp --sharp-enabled-group=V --create-all-gather-group
        --use-megatron-fsdp --data-parallel-sharding-strategy=V --outer-dp-sharding-strategy=V
        --no-gradient-reduce-div-fusion --fsdp-double-buffer --suggested-communication-unit-size=V
        --keep-fp8-transpose-cache --enable-full-sharding-in-hsdp
        --num-distributed-optimizer-instances=V --use-torch-fsdp2
        --torch-fsdp2-no-reshard-after-forward --cp-comm-type=V+ --nccl-communicator-config-path=V
        --use-tp-pp-dp-mapping --fake-process-group
    """,
    "validation": """
        --eval-iters=V --eval-interval=V --skip-train --test-mode --full-validation
        --multiple-validation-sets
    """,
    "data and dataloader": """
        --data-path=V+ --phase-transition-iterations=V --split=V --train-data-path=V+
        --valid-data-path=V+ --test-data-path=V+ --data-args-path=V --per-split-data-args-path=V
        --per-dataset-sequences-path=V --dataloader-fast-cache-load
        --dataloader-defer-npy-index-mmap --data-cache-path=V --no-mmap-bin-files --mock-data
        --seq-length=V --encoder-seq-length=V --decoder-seq-length=V --sample-rate=V --mask-prob=V
        --short-seq-prob=V --num-workers=V --reset-position-ids --reset-attention-mask
        --eod-mask-loss --no-create-attention-mask-in-dataloader --num-dataset-builder-threads=V
        --object-storage-cache-path=V --mid-level-dataset-surplus=V --allow-ambiguous-pad-tokens
        --fim-data --fim-rate=V --fim-spm-rate=V --fim-split-sample=V --fim-fragment-rate=V
        --fim-no-prefix=V --fim-prefix-token=V --fim-middle-token=V --fim-suffix-token=V
        --fim-pad-token=V --fim-eod-token=V
    """,
    "tokenizer": """
        --vocab-size=V --padded-vocab-size=V --vocab-file=V --merge-file=V --vocab-extra-ids=V
        --tokenizer-type=V --tokenizer-model=V --tokenizer-metadata=V --tokenizer-special-tokens=V+
        --legacy-tokenizer --tiktoken-pattern=V --tiktoken-num-special-tokens=V
        --tiktoken-special-tokens=V+ --tokenizer-sentencepiece-legacy --tokenizer-hf-use-fast
        --tokenizer-hf-include-special-tokens --trust-remote-code
    """,
    "logging": """
        --log-interval=V --log-params-norm --log-throughput --log-progress --timing-log-level=V
        --timing-log-option=V --tensorboard-dir=V --tensorboard-log-interval=V
        --tensorboard-queue-size=V --log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard
        --disable-log-loss-scale-to-tensorboard --log-validation-ppl-to-tensorboard
        --log-memory-to-tensorboard --log-memory-interval=V --log-device-memory-used
        --log-num-zeros-in-grad --log-max-attention-logit --no-barrier-with-level-1-timing
        --log-world-size-to-tensorboard --wandb-project=V --wandb-exp-name=V --wandb-save-dir=V
        --wandb-entity=V --logging-level=V --log-energy
    """,
    "Transformer-Engine": """
        --fp8-param-gather --te-precision-config-file=V
    """,
}

_KINDS = {"": "switch", "V": "value", "V+": "list"}

MEGATRON_FLAGS: tuple[tuple[str, str, str], ...] = tuple(
    (group, flag, _KINDS[value])
    for group, flags in _GROUPS.items()
    for flag, _, value in (word.partition("=") for word in flags.split())
)
"""(argument group, flag, kind) of every flag, in Megatron-LM's order."""
