"""Every Megatron-LM flag has an answer: implemented (a config field declares it), accepted as
restating this design, ignored with a logged note, CUDA-path only, or refused with one line
saying why.

`add_megatron_compat_arguments`, last in `build_parser`, registers every flag of
`megatron_flags.MEGATRON_FLAGS` the parser lacks with a `_CompatAction` that records its use;
`apply_megatron_compat` answers what was given and writes the design flags' effective values.
`compat_table` reads the answers back from the parser: docs/megatron-compat.md.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Optional

from megatron_ext.config.megatron_flags import MEGATRON_FLAGS, MEGATRON_LM_VERSION

logger = logging.getLogger(__name__)

__all__ = [
    "IMPLEMENTED",
    "DESIGN",
    "NOTED",
    "CUDA",
    "REFUSED",
    "DEFAULT_DIFFERENCES",
    "Rule",
    "add_megatron_compat_arguments",
    "apply_megatron_compat",
    "compat_table",
    "flag_status",
]

IMPLEMENTED = "implemented"
DESIGN = "accepted: restates the design"
NOTED = "accepted, ignored with a logged note"
CUDA = "CUDA path"
REFUSED = "refused"

_GIVEN = "_megatron_compat_given"


@dataclass(frozen=True)
class Rule:
    """What happens when a flag that is not implemented here is given."""

    status: str
    note: str  # one line: why, and what to use instead
    allowed: Optional[tuple] = None  # DESIGN value flags: the values that restate the design
    cpu_refused: bool = False  # CUDA-path flags: refused on CPU (else ignored with a note)
    effective: object = None  # DESIGN switches: the value the run uses (in args.json)
    choices: Optional[tuple] = None  # Megatron-LM's valid values
    default: object = argparse.SUPPRESS
    """The namespace's (args.json's) value when the flag is not given: Megatron-LM's default for
    the launch-script flags of this backbone's fixed design, else nothing."""


def _r(note: str) -> Rule:
    return Rule(REFUSED, note)


def _d(note: str, effective: object = True, allowed: Optional[tuple] = None, **default) -> Rule:
    return Rule(DESIGN, note, allowed, effective=effective, **default)


def _n(note: str, **default) -> Rule:
    return Rule(NOTED, note, **default)


def _c(note: str, cpu_refused: bool = False, choices: Optional[tuple] = None) -> Rule:
    return Rule(CUDA, note, cpu_refused=cpu_refused, choices=choices)


_NO_FUSION = "the local path runs no fused kernels; Transformer Engine fuses on its own"
_SWIGLU = "the MLP is SwiGLU (LLaMA-style backbone); drop the flag"
_ROPE = "positions are rotary (rope, base --rotary-base); drop the flag"
_DECODER = "models are decoder-only GPTs; use --num-layers / --seq-length"
_PP_SPLIT = "layers are split evenly over pipeline stages (1F1B); drop the flag"
_INTERLEAVED = (
    "virtual pipeline stages are set by --num-layers-per-virtual-pipeline-stage or "
    "--num-virtual-stages-per-pipeline-rank only; drop the flag"
)
_NO_RERUN = "Megatron's rerun state machine is not part of this loop; --skip-nonfinite-steps"
_FP8 = "FP8 runs through Transformer Engine on CUDA, with --fp8-format"
_TP_OVERLAP = "TP communication overlap needs Transformer Engine userbuffers on CUDA"
_DDP = (
    "tunes megatron-core's CUDA DDP buffers; on CPU, gloo ranks all-reduce bucketed "
    "gradients after backward, so it is ignored there"
)
_FSDP = "FSDP is not supported; use --use-distributed-optimizer (ZeRO-1) to shard Adam states"
_OFFLOAD = "CPU offloading is not supported; use --recompute-* or --use-distributed-optimizer"
_INFERENCE = "an inference-engine setting; training does not use it"
_TOKENIZER = "not supported by this package's tokenizers"
_CKPT_ONE_FORMAT = (
    "checkpoints are one format: torch.distributed.checkpoint with DTensor shards, not "
    "Megatron's torch_dist (see --ckpt-format)"
)
_MOE = "no mixture-of-experts layers: the backbone is dense"
_MAMBA = "the backbone is a transformer (no Mamba layers)"
_CP = "context parallelism is TE's p2p ring"
_MCORE_PP = "needs Megatron's CUDA pipeline schedules"
_CUDA_GRAPH = "CUDA graphs are not supported by this loop"
_ADAMW = "the optimizer is AdamW (--optimizer adam)"
_QK_CLIP = "QK-clip is a Muon recipe; the optimizer is AdamW"
_REPLICATION = "checkpoint replication is not supported; use shared storage"


def _each(flags: str, rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(flags.split(), rule)


# Every flag of MEGATRON_FLAGS that the parser lacks, by name, or by a prefix (ending in "-",
# tried in order after the names) (tests/training/test_megatron_compat.py).
_RULES: dict[str, Rule] = {
    # network size / transformer configuration
    "--apply-layernorm-1p": _d(
        "norm weights get no weight decay, so the zero-centred (1p) weight trains exactly like "
        "the RMSNorm weight used here"
    ),
    # The design flags of Megatron-LM GPT launch scripts keep a value in args.json (default).
    "--normalization": _d(
        "the Leviathan backbone is LLaMA-style and uses RMSNorm; drop the flag",
        "RMSNorm",
        ("RMSNorm",),
        default="RMSNorm",
    ),
    "--position-embedding-type": _d(
        "the Leviathan backbone uses rotary positions; drop the flag",
        "rope",
        ("rope",),
        default="rope",
    ),
    "--use-rotary-position-embeddings": _d("positions are rotary"),
    "--swiglu": _d("the MLP is SwiGLU"),
    "--disable-bias-linear": _d("linear layers have no bias"),
    "--use-mcore-models": _d("models are megatron-core GPTModels"),
    "--attention-softmax-in-fp32": _d("the attention softmax runs in float32"),
    "--accumulate-allreduce-grads-in-fp32": _d(
        "gradients are float32 (autocast keeps fp32 master weights)"
    ),
    "--use-flash-attn": _n("Transformer Engine picks its fused attention itself", default=False),
    **_each("--no-masked-softmax-fusion --no-bias-swiglu-fusion", _n(_NO_FUSION, default=False)),
    **_each("--no-bias-dropout-fusion --no-rope-fusion", _n(_NO_FUSION, default=False)),
    **_each("--no-bias-gelu-fusion --no-persist-layer-norm --disable-jit-fuser", _n(_NO_FUSION)),
    "--use-te-activation-func": _n(_NO_FUSION),
    "--no-gradient-accumulation-fusion": _n(
        "gradients accumulate in float32 .grad tensors", default=False
    ),
    **_each("--encoder-num-layers --decoder-num-layers --bert-no-binary-head", _r(_DECODER)),
    **_each("--encoder-seq-length --decoder-seq-length --vocab-extra-ids", _r(_DECODER)),
    **_each("--sample-rate --mask-prob --short-seq-prob", _r(_DECODER)),
    "--window-size": _r("attention is full causal attention (no sliding window)"),
    "--window-attn-skip-freq": _r("attention is full causal attention (no sliding window)"),
    **_each("--relative-attention-num-buckets --relative-attention-max-distance", _r(_ROPE)),
    "--no-position-embedding": _r(_ROPE),
    "--rotary-seq-len-interpolation-factor": _r("rotary scaling is not supported; " + _ROPE),
    "--use-rope-scaling": _r("LLaMA-3.1 rope scaling is not supported; " + _ROPE),
    "--rope-scaling-factor": _r("LLaMA-3.1 rope scaling is not supported; " + _ROPE),
    "--no-rope-freq": _r("every layer applies rotary positions; drop the flag"),
    "--mrope-section": _r("multimodal rope is not supported; " + _ROPE),
    "--rope-type": _d("plain rotary positions", "rope", ("rope",)),
    "--rotary-interleaved": _r("rotary uses the half-split (non-interleaved) layout"),
    **_each("--openai-gelu --squared-relu --quick-geglu --glu-linear-offset", _r(_SWIGLU)),
    **_each("--use-fused-weighted-squared-relu --activation-func-clamp-value", _r(_SWIGLU)),
    "--onnx-safe": _n("no ONNX export path here"),
    "--add-qkv-bias": _r("linear layers have no bias (LLaMA-style); drop the flag"),
    "--fp32-residual-connection": _r("not supported; --bf16 autocast keeps fp32 weights"),
    "--apply-residual-connection-post-layernorm": _r("the backbone is pre-norm"),
    "--qk-l2-norm": _r("use --qk-layernorm (RMSNorm on queries and keys)"),
    **_each("--qk-clip --qk-clip-alpha --qk-clip-threshold", _r(_QK_CLIP)),
    "--attention-output-gate": _r("attention has no output gate (LLaMA-style)"),
    "--softmax-type": _d("standard softmax attention", "vanilla", ("vanilla",)),
    "--multi-latent-attention": _r("attention is grouped-query attention (no MLA)"),
    "--experimental-attention-variant": _r("attention is grouped-query attention"),
    "--embedding-init-method-std": _r(
        "each input-embedding arm initialises as LEVIATHAN_SPEC.md says; "
        "--init-method-std sets the backbone"
    ),
    "--init-model-with-meta-device": _r("weights are built on CPU from one seeded stream"),
    "--no-initialization": _r("weights are always initialised (or loaded with --load)"),
    "--init-method-xavier-uniform": _r("the backbone uses normal(0, --init-method-std)"),
    "--data-parallel-random-init": _r("data-parallel replicas start from the same weights"),
    "--apply-query-key-layer-scaling": _n("the softmax runs in float32, so no scaling is needed"),
    "--disable-bf16-reduced-precision-matmul": _c("a cuBLAS setting; no effect on CPU"),
    "--distribute-saved-activations": _r("not supported; use --sequence-parallel"),
    "--recompute-modules": _d(
        "selective recomputation covers core attention", ["core_attn"], (["core_attn"],)
    ),
    "--deterministic-mode": _c("a CUDA kernel setting; CPU runs are deterministic"),
    "--batch-invariant-mode": _r("batch-invariant kernels are not supported"),
    "--cross-entropy-loss-fusion": _c("the fused cross entropy is a CUDA kernel"),
    "--cross-entropy-fusion-impl": _c(
        "the fused cross entropy is a CUDA kernel", choices=("native", "te")
    ),
    "--fp8-recipe": _c(
        _FP8, cpu_refused=True, choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
    ),
    "--attention-backend": _c(
        "Transformer Engine picks the attention kernel on CUDA; the local path computes "
        "unfused attention on CPU",
        choices=("flash", "fused", "unfused", "local", "auto"),
    ),
    "--no-clone-scatter-output-in-embedding": _n("an embedding memory tweak; no effect here"),
    "--disable-clone-scatter-output-in-embedding": _n("an embedding memory tweak; no effect here"),
    "--config-logger-dir": _r("use --log-jsonl and the TensorBoard config text"),
    **_each("--is-hybrid-model --disable-mamba-mem-eff-path", _r(_MAMBA)),
    # parallelism
    "--pipeline-model-parallel-comm-backend": _n("p2p goes through the default process group"),
    **_each("--hierarchical-context-parallel-sizes --hybrid-context-parallel", _r(_CP)),
    "--max-seqlen-per-dp-cp-rank": _r(_CP),
    "--cp-comm-type": _d(_CP, ["p2p"], (["p2p"],)),
    "--no-async-tensor-model-parallel-allreduce": _n("a CUDA overlap knob; no effect here"),
    "--disable-async-tensor-model-parallel-allreduce": _n("a CUDA overlap knob; no effect here"),
    "--use-ring-exchange-p2p": _n("p2p sends and receives are batched per step"),
    "--overlap-p2p-communication-warmup-flush": _r(_INTERLEAVED),
    "--microbatch-group-size-per-virtual-pipeline-stage": _r(_INTERLEAVED),
    "--no-overlap-p2p-communication": _d("p2p communication is not overlapped"),
    **_each("--defer-embedding-wgrad-compute --wgrad-deferral-limit", _r(_MCORE_PP)),
    "--delay-wgrad-compute": _r(_MCORE_PP),
    "--account-for-embedding-in-pipeline-split": _r(_PP_SPLIT),
    **_each("--account-for-loss-in-pipeline-split --pipeline-model-parallel-layout", _r(_PP_SPLIT)),
    "--decoder-first-pipeline-num-layers": _r(_PP_SPLIT),
    "--decoder-last-pipeline-num-layers": _r(_PP_SPLIT),
    "--model-parallel-size": _r("removed in Megatron-LM too; use --tensor-model-parallel-size"),
    "--distributed-timeout-seconds-after-init": _r("use --distributed-timeout-minutes"),
    "--no-scatter-gather-tensors-in-pipeline": _d("pipeline tensors are sent whole"),
    "--local-rank": _n("read from LOCAL_RANK, which torchrun sets"),
    "--lazy-mpu-init": _r("process groups are created by pretrain()"),
    "--use-nccl-ub": _c("NCCL user buffers; no effect with gloo"),
    "--disable-symmetric-registration": _c("NCCL user buffers; no effect with gloo"),
    "--use-sharp": _c("an InfiniBand SHARP setting; no effect with gloo"),
    "--sharp-enabled-group": _c("an InfiniBand SHARP setting; no effect with gloo"),
    "--create-all-gather-group": _c("a CUDA overlap knob; no effect with gloo"),
    "--nccl-communicator-config-path": _c("an NCCL setting; no effect with gloo"),
    **_each("--no-gradient-reduce-div-fusion --overlap-param-gather-with-optimizer-step", _c(_DDP)),
    **_each("--no-align-grad-reduce --no-align-param-gather --ddp-", _c(_DDP)),
    "--num-distributed-optimizer-instances": _d("one distributed-optimizer instance", 1, (1,)),
    "--data-parallel-sharding-strategy": _d(
        "no FSDP sharding (use --use-distributed-optimizer)", "no_shard", ("no_shard",)
    ),
    "--outer-dp-sharding-strategy": _d("no HSDP", "no_shard", ("no_shard",)),
    "--use-tp-pp-dp-mapping": _r("rank order is megatron-core's default tp-cp-ep-dp-pp"),
    "--fake-process-group": _r("runs need real ranks (gloo on CPU is cheap)"),
    "--expert-model-parallel-size": _d("no mixture-of-experts layers", 1, (1,)),
    "--expert-tensor-parallel-size": _r("no mixture-of-experts layers (dense backbone)"),
    # training
    "--decrease-batch-size-if-needed": _r("make --global-batch-size divisible instead"),
    "--check-weight-hash-across-dp-replicas-interval": _r(_NO_RERUN),
    "--train-sync-interval": _n("a CUDA host-sync knob; no effect here"),
    "--exit-signal": _d("the handler catches SIGTERM", "SIGTERM", ("SIGTERM",)),
    "--exit-signal-handler-for-dataloader": _r("dataloader workers exit with the rank"),
    "--iterations-to-skip": _r("use --skip-nonfinite-steps to skip bad steps"),
    "--batch-size": _r("removed in Megatron-LM too; use --micro-batch-size"),
    **_each("--check-for-large-grads --result-rejected-tracker-filename", _r(_NO_RERUN)),
    "--disable-gloo-process-groups": _n("megatron-core gloo side groups are not created here"),
    "--checkpoint-activations": _r("removed in Megatron-LM too; use --recompute-activations"),
    "--dump-param-to-param-group-map": _r("parameter groups are logged at start-up"),
    "--use-legacy-models": _r("only megatron-core models (Megatron's legacy models are gone)"),
    "--high-priority-stream-groups": _c("a CUDA stream setting; no effect on CPU"),
    "--te-precision-config-file": _c("a Transformer Engine precision recipe", cpu_refused=True),
    "--te-rng-tracker": _c("Transformer Engine's RNG tracker; the local path uses megatron's"),
    "--warmup": _r("removed in Megatron-LM too; use --lr-warmup-fraction"),
    **_each("--sgd-momentum --muon-", _r(_ADAMW)),
    "--apply-wd-to-qk-layernorm": _r("norm weights (qk-layernorm included) get no weight decay"),
    "--no-weight-decay-cond-type": _r("norm weights (qk-layernorm included) get no weight decay"),
    # profiling
    "--use-pytorch-profiler": _d("--profile always uses torch.profiler"),
    "--record-memory-history": _c("CUDA caching-allocator history", cpu_refused=True),
    "--memory-snapshot-path": _c("CUDA caching-allocator history", cpu_refused=True),
    # checkpointing
    "--persistent-save-interval": _r("use --save-interval"),
    **_each("--save-wgrads-interval --save-dgrads-interval", _r("gradients are not checkpointed")),
    "--save-retain-interval": _r("use --ckpt-keep-last N"),
    "--load-main-params-from-ckpt": _r("weights are float32; --load restores them"),
    "--pretrained-checkpoint": _r("use --load with --finetune"),
    "--use-mp-args-from-checkpoint-args": _r("use --use-checkpoint-args"),
    "--no-use-tokenizer-model-from-checkpoint-args": _n("--use-checkpoint-args restores it"),
    "--disable-use-tokenizer-model-from-checkpoint-args": _n("--use-checkpoint-args restores it"),
    **_each("--auto-detect-ckpt-format --use-dist-ckpt", _d(_CKPT_ONE_FORMAT)),
    "--no-ckpt-fully-parallel-save": _n("every rank writes its own shards"),
    "--disable-ckpt-fully-parallel-save": _n("every rank writes its own shards"),
    "--ckpt-fully-parallel-save": _d("every rank writes its own shards"),
    "--ckpt-fully-parallel-load": _d("every rank reads its own shards"),
    "--use-persistent-ckpt-worker": _n("--async-save writes from a thread of each rank"),
    "--ckpt-assume-constant-structure": _n("a save-planning cache; no effect here"),
    "--dist-ckpt-strictness": _d(
        "missing or unexpected keys are errors",
        "raise_all",
        ("raise_all", "assume_ok_unexpected"),
    ),
    "--dist-ckpt-save-pre-mcore-014": _r(_CKPT_ONE_FORMAT),
    "--dist-ckpt-optim-fully-reshardable": _d("optimizer states reshard to any layout"),
    "--distrib-optim-fully-reshardable-mem-efficient": _d("optimizer states reshard to any layout"),
    "--dist-ckpt-format": _d(_CKPT_ONE_FORMAT, "torch_dist", ("torch_dist",)),
    **_each("--replication --replication-jump --replication-factor", _r(_REPLICATION)),
    # mixed precision
    "--fp16-lm-cross-entropy": _r("the cross entropy runs in float32"),
    # validation
    "--test-mode": _r("a Megatron-LM self-test mode"),
    "--full-validation": _r("validation reads --eval-iters batches; raise it"),
    "--multiple-validation-sets": _r("use one --valid-data-path blend"),
    # data
    "--phase-transition-iterations": _r("use separate runs with --load for each phase"),
    "--data-args-path": _r("pass the blend with --data-path"),
    "--per-split-data-args-path": _r("pass the blends with --train/--valid/--test-data-path"),
    "--per-dataset-sequences-path": _r("sequence counts are read from each .idx file"),
    "--dataloader-fast-cache-load": _n("the sample-index cache is loaded as is"),
    "--dataloader-defer-npy-index-mmap": _n("the sample-index cache is loaded as is"),
    "--object-storage-cache-path": _r("data is read from local files"),
    "--mid-level-dataset-surplus": _n("megatron-core's default surplus is used"),
    "--fim-": _r("fill-in-the-middle samples are not built; preprocess them yourself"),
    # tokenizer
    "--padded-vocab-size": _r("derived from --make-vocab-size-divisible-by x TP"),
    **_each("--allow-ambiguous-pad-tokens --tokenizer-metadata", _r(_TOKENIZER)),
    **_each("--tokenizer-special-tokens --tokenizer-sentencepiece-legacy", _r(_TOKENIZER)),
    "--legacy-tokenizer": _d("tokenizers follow Megatron-LM's type names"),
    "--tiktoken-num-special-tokens": _r("TikTokenizer adds <|endoftext|> and <|pad|> only"),
    "--tiktoken-special-tokens": _r("TikTokenizer adds <|endoftext|> and <|pad|> only"),
    "--tokenizer-hf-use-fast": _d("Hugging Face tokenizers load their fast version"),
    "--tokenizer-hf-include-special-tokens": _r("text is tokenized without special tokens"),
    "--trust-remote-code": _r("tokenizers load from local files only (no remote code)"),
    # logging
    "--log-progress": _r("use --log-jsonl (one record per iteration)"),
    "--timing-log-option": _n("timers are rank 0's"),
    "--log-memory-interval": _n("memory is logged every --tensorboard-log-interval"),
    "--log-device-memory-used": _c("CUDA device memory; use --log-memory-to-tensorboard"),
    "--log-max-attention-logit": _r("needs Transformer Engine >= 2.9 attention internals"),
    "--no-barrier-with-level-1-timing": _n("timers synchronise only the local device"),
    "--log-energy": _c("GPU energy counters", cpu_refused=True),
    # families
    **_each("--moe- --overlap-moe- --ep-overlap-", _r(_MOE)),
    "--mtp-": _r("no multi-token prediction; the loss is next-token"),
    "--mamba-": _r(_MAMBA),
    "--dsa-": _r("attention is grouped-query attention (no sparse attention)"),
    "--linear-": _r("attention is grouped-query attention (no linear attention)"),
    "--fp4-": _r("FP4 needs Transformer Engine on Blackwell GPUs; not supported"),
    **_each("--fp8- --no-fp8- --disable-fp8- --first-last-layers-bf16", _c(_FP8, cpu_refused=True)),
    **_each("--num-layers-at- --reuse-grad-buf-for-mxfp8-param-ag", _c(_FP8, cpu_refused=True)),
    **_each("--kitchen- --use-kitchen-", _r("NVIDIA Kitchen quantization is not supported")),
    "--tp-comm-overlap-cfg": _c(_TP_OVERLAP, cpu_refused=True),
    **_each("--tp-comm- --no-tp-comm- --disable-tp-comm-", _c(_TP_OVERLAP, cpu_refused=True)),
    **_each("--enable-cuda-graph --cuda-graph- --external-cuda-graph", _r(_CUDA_GRAPH)),
    **_each("--keep-fp8- --fsdp- --use-megatron-fsdp --use-torch-fsdp2 --torch-fsdp2-", _r(_FSDP)),
    **_each("--enable-full-sharding-in-hsdp --suggested-communication-unit-size", _r(_FSDP)),
    **_each("--no-strict-fsdp- --disable-strict-fsdp-", _r(_FSDP)),
    **_each("--optimizer-cpu-offload --optimizer-offload- --overlap-cpu-optimizer-", _r(_OFFLOAD)),
    **_each("--use-torch-optimizer-for-cpu-offload --no-pin-cpu- --offload-modules", _r(_OFFLOAD)),
    **_each("--cpu-offloading-num-layers --min-offloaded-tensor-size", _r(_OFFLOAD)),
    "--fine-grained-activation-offloading": _r(_OFFLOAD),
    **_each("--inference-rng-tracker --inference- --symmetric-ar-type", _n(_INFERENCE)),
    **_each("--flash-decode --mlp-chunks-for-prefill", _n(_INFERENCE)),
    "--non-persistent-": _r("only persistent checkpoints (--save/--save-interval)"),
    "--ckpt-convert-": _r("convert with tools/convert_checkpoint.py"),
}


_SAME_SWITCH = "the same unset switch (Megatron-LM's None is off)"
_FUSION = (
    "stored under the flag's own name, no_*: false, where Megatron-LM stores the inverse (its "
    "fusion switch: true); the same unset flag, noted and ignored"
)

# Megatron-LM core_v0.16.1's default of every flag whose default differs here, and why (every
# other shared flag defaults as there: tests/training/test_megatron_compat.py).
DEFAULT_DIFFERENCES: dict[str, tuple[object, Optional[str]]] = {
    "--distributed-backend": (
        "nccl",
        "picked per machine: nccl on CUDA (Megatron-LM's), gloo on CPU",
    ),
    "--dataloader-type": (None, "Megatron-LM's validate_args sets single when unset"),
    "--no-save-optim": (None, _SAME_SWITCH),
    "--no-save-rng": (None, _SAME_SWITCH),
    "--no-load-optim": (None, _SAME_SWITCH),
    "--no-load-rng": (None, _SAME_SWITCH),
    "--ckpt-format": (
        "torch_dist",
        "checkpoints are one format, torch.distributed.checkpoint with DTensor shards; torch_dist "
        "is accepted and means torch_dcp",
    ),
    "--num-query-groups": (
        1,
        "None is one key/value group per head; with --group-query-attention Megatron-LM's 1 "
        "applies, so a script trains the model it trained there",
    ),
    "--transformer-impl": (
        "transformer_engine",
        "transformer_engine where Transformer Engine and a GPU are present (Megatron-LM's), else "
        "local",
    ),
    "--use-cpu-initialization": (
        None,
        "weights are initialised on CPU from one seeded stream, so every TP size starts from the "
        "same model (the numerics checks compare TP with TP=1)",
    ),
    "--split": (None, "Megatron-LM's validate_args sets 969, 30, 1 for --data-path when unset"),
    "--tiktoken-pattern": (
        None,
        "this package's TikTokenizer patterns are o200k and cl100k (Megatron-LM's v1 and v2 have "
        "no default)",
    ),
    "--no-masked-softmax-fusion": (True, _FUSION),
    "--no-bias-swiglu-fusion": (True, _FUSION),
    "--no-bias-dropout-fusion": (True, _FUSION),
    "--no-rope-fusion": (True, _FUSION),
    "--no-gradient-accumulation-fusion": (True, _FUSION),
    # None: the fixed design (the rule's note says why). A design switch is on here, and off in
    # Megatron-LM unless it spells the inverse there (--no-*, --disable-*).
    **{
        flag: (False, None)
        for _, flag, kind in MEGATRON_FLAGS
        if kind == "switch"
        and getattr(_RULES.get(flag), "status", None) == DESIGN
        and not flag.startswith(("--no-", "--disable-"))
    },
    "--position-embedding-type": ("learned_absolute", None),
    "--normalization": ("LayerNorm", None),
}


def rule_for(flag: str) -> Optional[Rule]:
    """The rule of a flag that is not implemented here (None: no rule)."""
    if flag in _RULES:
        return _RULES[flag]
    prefixes = (rule for key, rule in _RULES.items() if key[-1] == "-" and flag.startswith(key))
    return next(prefixes, None)


class _CompatAction(argparse.Action):
    """Stores the value like Megatron-LM and remembers that the flag was given."""

    def __init__(self, option_strings, dest, megatron_rule: Rule, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.megatron_rule = megatron_rule

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = True if self.nargs == 0 else values
        setattr(namespace, self.dest, value)
        setattr(namespace, _GIVEN, {**getattr(namespace, _GIVEN, {}), option_string: value})


def add_megatron_compat_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Answer every Megatron-LM flag the parser does not know yet (by a rule)."""
    known = parser._option_string_actions
    group = parser.add_argument_group(
        "Megatron-LM flags answered here",
        f"Megatron-LM {MEGATRON_LM_VERSION} flags: accepted, noted, CUDA-path or refused "
        "(docs/megatron-compat.md)",
    )
    for _, flag, kind in MEGATRON_FLAGS:
        rule = rule_for(flag)
        if flag in known or rule is None:  # implemented, or left unknown (the compat test)
            continue
        group.add_argument(
            flag,
            dest=flag[2:].replace("-", "_"),
            action=_CompatAction,
            megatron_rule=rule,
            # The dump (args.json) shows what was given, else a design switch's effective value
            # (what the run does, not what was typed) or the rule's default.
            default=rule.effective
            if kind == "switch" and rule.effective is not None
            else rule.default,
            help=f"[{rule.status}] {rule.note}",
            nargs={"switch": 0, "list": "+"}.get(kind),
            **({"choices": rule.choices} if rule.choices and kind != "switch" else {}),
        )
    return parser


def flag_status(parser: argparse.ArgumentParser, flag: str) -> tuple[str, str]:
    """(status, note) of a flag as the parser handles it; ("unknown", "") when it does not."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        return "unknown", ""
    rule = getattr(action, "megatron_rule", None)
    if rule is None:
        return IMPLEMENTED, " ".join((action.help or "").split())
    note = rule.note
    if rule.status == CUDA:
        note += "; on CPU: " + ("refused" if rule.cpu_refused else "ignored with a logged note")
    if rule.allowed is not None:
        note += "; accepted values: " + ", ".join(str(v) for v in rule.allowed)
    if rule.choices is not None:
        note += "; values: " + ", ".join(rule.choices)
    return rule.status, note


def _value_allowed(rule: Rule, value) -> bool:
    if rule.allowed is None:
        return rule.status != REFUSED
    return any(value == allowed or str(value) == str(allowed) for allowed in rule.allowed)


# Any of these on the command line asks for the LLaMA-style backbone (Megatron-LM's LLaMA
# scripts pass them); none of them is a GPT-3-style script.
_BACKBONE_FLAGS = (
    "--swiglu",
    "--normalization",
    "--position-embedding-type",
    "--use-rotary-position-embeddings",
)


def apply_megatron_compat(
    args: argparse.Namespace, cuda: bool, fp8: bool = False
) -> argparse.Namespace:
    """Refuse, note or accept the compatibility flags given (`fp8`: the run has --fp8-format).

    Raises:
        ValueError: naming the first refused flag and why.
    """
    given = vars(args).pop(_GIVEN, None) or {}
    for flag, value in given.items():
        rule = rule_for(flag)  # a `_CompatAction`'s flag: it has one
        shown = flag if value is True else f"{flag} {value}"
        if flag.startswith("--fp8-") and not fp8:
            raise ValueError(f"{flag} needs --fp8-format (FP8 through Transformer Engine on CUDA)")
        if rule.status == CUDA:
            if cuda:
                logger.info(
                    "%s: a CUDA-path flag, not applied by this build yet (%s)", flag, rule.note
                )
            elif rule.cpu_refused:
                raise ValueError(f"{shown}: {rule.note}; drop it on CPU")
            else:
                logger.info("%s: ignored on CPU (%s)", flag, rule.note)
        elif rule.status == NOTED:
            logger.info("%s: ignored (%s)", flag, rule.note)
        elif not _value_allowed(rule, value):
            raise ValueError(f"{shown}: {rule.note}")
    if not any(flag in given for flag in _BACKBONE_FLAGS):
        logger.info(
            "model: no %s given (a GPT-3-style command line, which in Megatron-LM means "
            "learned absolute positions, LayerNorm and a GeLU MLP): this package trains its "
            "LLaMA-style backbone, rotary positions, RMSNorm and a SwiGLU MLP",
            ", ".join(_BACKBONE_FLAGS[:3]),
        )
    return args


def compat_table(parser: argparse.ArgumentParser) -> str:
    """docs/megatron-compat.md: one row per Megatron-LM flag, read from the entry point's parser
    (`config.arguments.build_parser`; `training.compat_doc` writes the file)."""
    rows, counts = [], {}
    for group, flag, _ in MEGATRON_FLAGS:
        status, note = flag_status(parser, flag)
        counts[status] = counts.get(status, 0) + 1
        rows.append(f"| `{flag}` | {group} | {status} | {note.replace('|', '/')} |")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    head = [
        "# Megatron-LM flag compatibility",
        "",
        "<!-- generated by `python -m megatron_ext.training.compat_doc --write "
        "docs/megatron-compat.md`; do not edit -->",
        "",
        f"Every flag that Megatron-LM {MEGATRON_LM_VERSION} registers in its network-size, "
        "transformer-configuration, regularisation, training, profiling, initialisation, "
        "learning-rate, checkpointing, mixed-precision, distributed, validation, data, "
        "tokenizer, logging and Transformer-Engine groups, and how `pretrain_leviathan.py` "
        "answers it "
        f"({len(rows)} flags: {summary}).",
        "",
        "- **implemented**: Megatron-LM's meaning.",
        f"- **{DESIGN}**: the flag asks for what this LLaMA-style design always does; values "
        "asking for another design are refused.",
        f"- **{NOTED}**: a performance knob with no counterpart here; the run logs a note.",
        f"- **{CUDA}**: parsed and validated; takes effect with the CUDA path. On CPU it is "
        "ignored with a logged note or refused, as the row says.",
        f"- **{REFUSED}**: the run stops with one line saying why and what to use instead.",
        "",
        "`--decoupled-lr` / `--decoupled-min-lr` apply, as in Megatron-LM, to the input "
        "embedding and the output layer: for `--embedding-type lev` that is every LEV "
        "generator parameter plus the head, the knob a LEV user tunes.",
        "",
        "| flag | Megatron-LM group | status | note |",
        "|---|---|---|---|",
    ]
    defaults = [
        "",
        "## Defaults that differ from Megatron-LM's",
        "",
        "Every flag the parser shares with Megatron-LM defaults as there (a launch script that "
        "relies on a default trains what it trained there: `--hidden-dropout` and "
        "`--attention-dropout` 0.1, `--fp8-amax-history-len` 1, `--fp8-amax-compute-algo` "
        "most_recent, `--eval-interval` unset), but these "
        f"{len(DEFAULT_DIFFERENCES)}: the fixed design, or the same value spelled otherwise.",
        "",
        "| flag | default here | Megatron-LM's | why |",
        "|---|---|---|---|",
    ]
    for flag, (theirs, why) in DEFAULT_DIFFERENCES.items():
        action = parser._option_string_actions[flag]
        why = why or "the fixed design: " + action.megatron_rule.note
        here = f"`{action.default}`"
        if flag == "--transformer-impl":  # per machine
            here = "`local` (`transformer_engine` with TE and a GPU)"
        defaults.append(f"| `{flag}` | {here} | `{theirs}` | {why} |")
    return "\n".join(head + rows + defaults) + "\n"
