"""Per-GPU memory and FLOPs of a training run, on paper (nothing is allocated).

`estimate_memory(cfg, layout)` splits one GPU's memory into weights, gradients, optimizer states
and activations (with and without full recompute) for the most loaded pipeline stage;
`estimate_save_memory` and `estimate_export_memory` plan a checkpoint save and ``export-hf``;
`flops_per_token` counts the training FLOPs of one token.

Activations follow what the local (portable) path saves for backward, tensor by tensor
(tests/models/test_memory.py counts them); a process's runtime (Python, torch, gloo or CUDA) is
not planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.models.param_count import (
    count_parameters,
    layer_matmul_parameters,
    resolve_embedding_sizes,
)

__all__ = [
    "TrainingPlan",
    "MemoryEstimate",
    "estimate_export_memory",
    "estimate_memory",
    "estimate_save_memory",
    "flops_per_token",
]

_ENGINES = ("portable", "megatron")


@dataclass(frozen=True)
class TrainingPlan:
    """How a run is laid out and trained (what memory depends on besides the model): the
    run's own `ParallelConfig` (TP, PP, DP, sequence parallelism, distributed optimizer) and
    `PrecisionConfig` (--bf16: the activations' dtype), the engine and the micro-batching."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(bf16=True))
    micro_batch_size: int = 1
    num_micro_batches: int = 1  # per step per DP rank (how many are in flight under PP)
    engine: str = "portable"  # float32 params/grads + autocast; megatron: bf16 params
    unique_fraction: float = 1.0  # distinct ids per token of a micro-batch (LEV; 1 = bound)

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise ValueError("--micro-batch-size and the micro-batch count must be >= 1")
        if self.engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {self.engine!r}")
        if not 0 < self.unique_fraction <= 1:
            raise ValueError(f"unique_fraction must be in (0, 1], got {self.unique_fraction}")

    @property
    def autocast_weight_copies(self) -> bool:
        """The portable engine under --bf16 keeps bf16 copies of fp32 weights for backward."""
        return self.precision.bf16 and self.engine == "portable"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded GPU (the larger of the first and last pipeline stage)."""

    parameters: int  # held by that GPU
    weights: int
    grads: int
    optimizer: int
    activations: int  # saved for backward by all micro-batches in flight, no recompute
    activations_recompute: int  # with full recompute (only layer inputs kept, one layer live)

    @property
    def total(self) -> int:
        """Bytes of weights, gradients, optimizer states and activations without recompute."""
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def total_recompute(self) -> int:
        """Bytes of weights, gradients, optimizer states and activations under full recompute."""
        return self.weights + self.grads + self.optimizer + self.activations_recompute


def _state_bytes(layout: TrainingPlan) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer states) on one GPU."""
    dp = layout.parallel.data_parallel_size if layout.parallel.use_distributed_optimizer else 1
    if layout.engine == "megatron" and layout.precision.bf16:
        # bf16 weights, fp32 main-grad buffer, fp32 master copy + Adam m, v (sharded over DP).
        return 2.0, 4.0, 12.0 / dp
    # float32 weights and gradients; Adam m, v (ZeRO-1 shards them over DP).
    return 4.0, 4.0, 8.0 / dp


def _layer_activation_bytes(cfg: ModelConfig, layout: TrainingPlan) -> float:
    """Bytes one decoder layer saves for backward for one micro-batch (see the module doc)."""
    tp = layout.parallel.tensor_model_parallel_size
    sp = tp if layout.parallel.sequence_parallel else 1
    b, s, d = layout.micro_batch_size, cfg.seq_length, cfg.hidden_size
    t = b * s
    hd = cfg.kv_channels
    heads, kv = cfg.num_attention_heads / tp, cfg.num_query_groups * hd / tp
    f = cfg.ffn_hidden_size / tp
    a = 2 if layout.precision.bf16 else 4
    stream = 4 * (2 * t + 4 * t * d) / sp
    linear_inputs = a * 2 * t * d  # saved after the sequence-parallel all-gather: full size
    attention = a * (t * heads * hd + t * kv + t * (heads * hd + 2 * kv))
    attention += 4 * b * heads * s + a * t * heads * hd
    mlp = a * 4 * t * f  # models.local_modules.SwiGLUMLP: [T, 2F] + 2 x [T, F]
    weights = a * layer_matmul_parameters(cfg) / tp if layout.autocast_weight_copies else 0
    return stream + linear_inputs + attention + mlp + weights


def _input_activation_bytes(cfg: ModelConfig, layout: TrainingPlan) -> float:
    """Bytes the first stage saves outside the layers: ids, input embedding, embedding output."""
    tp = layout.parallel.tensor_model_parallel_size
    sp = tp if layout.parallel.sequence_parallel else 1
    t = layout.micro_batch_size * cfg.seq_length
    emb = cfg.embedding
    total = 8 * t + 4 * t * cfg.hidden_size / sp  # ids (or LEV's gather index), output [T, D]
    if emb.embedding_type == "lev":
        lev = emb.lev
        u = max(1.0, min(t * layout.unique_fraction, cfg.vocab_size))
        # The seeds [U, d_in] are saved unless LEV projects by digit (U > k*b), which saves the
        # codebooks themselves (parameters) instead.
        seed = 0 if lev.projects_by_digit(u) else 4 * lev.seed_in_dim
        total += u * (8 * lev.num_digits + seed + 4 * lev.num_heads * lev.rank / tp)
    elif emb.embedding_type in ("tied", "untied") and tp > 1:
        total += t  # the vocab-parallel lookup's out-of-shard mask [T] (bool)
    elif emb.embedding_type == "albert":
        # The seed networks run in float32 outside autocast (training/precision.py).
        total += 4 * t * emb.albert_dim
    elif emb.embedding_type in ("flat-mlp", "factored-mlp"):
        seed = emb.flat_mlp_seed_dim
        if emb.embedding_type == "factored-mlp":
            lev = emb.lev
            seed = lev.seed_in_dim
            total += 8 * t * (lev.num_digits - 1)  # the digits [T, k] replace the ids [T]
        # All in float32 (outside autocast): the seed [T, d] and LayerNorm statistics, the fc1
        # input (normed seed), fc1 output (SiLU input) and SiLU output.
        hidden = emb.mlp_hidden
        total += 4 * t * seed + 8 * t + 4 * t * (seed + 2 * hidden)
    return total


def _output_activation_bytes(cfg: ModelConfig, layout: TrainingPlan) -> float:
    """Bytes the last stage saves after the layers: final norm, head input, logits, labels."""
    tp = layout.parallel.tensor_model_parallel_size
    sp = tp if layout.parallel.sequence_parallel else 1
    t = layout.micro_batch_size * cfg.seq_length
    a = 2 if layout.precision.bf16 else 4
    head_weight = a * cfg.vocab_size * cfg.hidden_size / tp if layout.autocast_weight_copies else 0
    norm = 4 * (t + t * cfg.hidden_size) / sp
    loss = 9 * t  # a bool mask and the int64 labels [T]
    # The head's input copy is saved after the sequence-parallel all-gather (full [T, D]).
    return norm + a * t * cfg.hidden_size + head_weight + 4 * t * cfg.vocab_size / tp + loss


def _stage_parameters(cfg: ModelConfig, layout: TrainingPlan) -> tuple[int, int]:
    """Parameters on one GPU of the first and of the last pipeline stage."""
    tp, pp = (
        layout.parallel.tensor_model_parallel_size,
        layout.parallel.pipeline_model_parallel_size,
    )
    count = count_parameters(cfg)
    layers = (count.backbone - cfg.hidden_size) / pp / tp
    emb = cfg.embedding
    if emb.embedding_type == "lev":
        codebooks = emb.lev.num_codebook_parameters
        input_side = codebooks + (count.input_embedding - codebooks) / tp
    elif emb.embedding_type in ("tied", "untied"):
        input_side = count.input_embedding / tp
    else:  # the seed tables and MLPs of the matched arms are replicated over TP
        input_side = count.input_embedding
    head = cfg.vocab_size * cfg.hidden_size / tp  # tied: the last stage's copy when pp > 1
    if pp == 1:
        total = layers + input_side + (0 if emb.tied else head) + cfg.hidden_size
        return int(total), int(total)
    return int(layers + input_side), int(layers + head + cfg.hidden_size)


def estimate_memory(cfg: ModelConfig, layout: TrainingPlan) -> MemoryEstimate:
    """Memory of the most loaded GPU of `layout` training `cfg` (see the module docstring)."""
    cfg = resolve_embedding_sizes(cfg, log=False)
    pp = layout.parallel.pipeline_model_parallel_size
    if cfg.num_layers % pp:
        raise ValueError(f"--num-layers {cfg.num_layers} is not divisible by PP size {pp}")
    first, last = _stage_parameters(cfg, layout)
    w, g, o = _state_bytes(layout)
    layers = cfg.num_layers // pp
    per_layer = _layer_activation_bytes(cfg, layout)
    layer_input = 4 * layout.micro_batch_size * cfg.seq_length * cfg.hidden_size
    layer_input /= (
        layout.parallel.tensor_model_parallel_size if layout.parallel.sequence_parallel else 1
    )
    # 1F1B: stage i holds up to pp - i micro-batches in flight (stage 0 the most).
    in_flight_first = min(pp, layout.num_micro_batches)
    head = _output_activation_bytes(cfg, layout)
    inputs = _input_activation_bytes(cfg, layout)
    # The rotary cos/sin tables, shared by the stage's layers and micro-batches.
    rotary_dim = int(cfg.kv_channels * cfg.rotary_percent)
    rope = (2 if layout.precision.bf16 else 4) * 2 * cfg.seq_length * rotary_dim
    if pp == 1:
        act = layers * per_layer + inputs + head + rope
        act_rc = layers * layer_input + per_layer + inputs + head + rope
        params = first
    else:
        act_first = in_flight_first * (layers * per_layer + inputs) + rope
        act_last = layers * per_layer + head + rope
        rc_first = in_flight_first * (layers * layer_input + inputs) + per_layer + rope
        rc_last = layers * layer_input + per_layer + head + rope
        first_total = first * (w + g + o) + act_first
        last_total = last * (w + g + o) + act_last
        if first_total >= last_total:
            params, act, act_rc = first, act_first, rc_first
        else:
            params, act, act_rc = last, act_last, rc_last
    return MemoryEstimate(
        parameters=params,
        weights=int(params * w),
        grads=int(params * g),
        optimizer=int(params * o),
        activations=int(act),
        activations_recompute=int(act_rc),
    )


def estimate_save_memory(cfg: ModelConfig, layout: TrainingPlan) -> int:
    """Bytes of the most loaded GPU while it saves a checkpoint after a step: the step's own
    figure. The save adds nothing of the model's size (torch.distributed.checkpoint streams each
    tensor from its storage), and the step's freed activations stay with the allocator
    (measured: benchmarks/RESULTS.md)."""
    return estimate_memory(cfg, layout).total


def estimate_export_memory(
    cfg: ModelConfig, exported_vocab: Optional[int] = None, dtype_bytes: int = 4
) -> int:
    """Bytes of ``tools/convert_checkpoint.py export-hf`` from a TP=1 checkpoint: the model in
    float32, plus the larger of the load's buffer for the largest stored tensor and the
    conversion's copies: the input table [V', D] in the stored dtype (`dtype_bytes`; V' =
    `exported_vocab`, default the padded V), every layer's Q, K, V split out of the fused QKV
    weight, and for a dtype other than float32 the cast of the other parameters.
    """
    cfg = resolve_embedding_sizes(cfg, log=False)
    count = count_parameters(cfg)
    vocab = exported_vocab or cfg.vocab_size
    weights = 4 * count.total
    largest = 4 * max(cfg.vocab_size * cfg.hidden_size, 2 * cfg.ffn_hidden_size * cfg.hidden_size)
    # A lookup table kept in float32 is the weight itself; a generated arm's is a new tensor.
    lookup = cfg.embedding.embedding_type in ("tied", "untied") and dtype_bytes == 4
    table = 0 if lookup else dtype_bytes * vocab * cfg.hidden_size
    heads = cfg.num_attention_heads + 2 * cfg.num_query_groups
    qkv = 4 * cfg.hidden_size * cfg.kv_channels * heads
    cast = 0 if dtype_bytes == 4 else dtype_bytes * (count.total - count.input_embedding)
    return int(weights + max(largest, table + cfg.num_layers * qkv + cast))


def flops_per_token(cfg: ModelConfig, recompute: bool = False, unique_fraction: float = 1.0):
    """Training FLOPs (forward + backward) of one token, whole model (all GPUs together).

    6 FLOPs per matmul parameter per token; attention adds 2 * 2 * s * D per layer forward (full
    s x s, Megatron-LM's and PaLM's MFU convention). LEV runs its forward twice (recompute in
    backward) per distinct id. Full recompute adds one more forward of the layers.
    """
    cfg = resolve_embedding_sizes(cfg, log=False)
    d, s, layers = cfg.hidden_size, cfg.seq_length, cfg.num_layers
    layer_fwd = 2 * layer_matmul_parameters(cfg) + 4 * s * d
    head_fwd = 2 * cfg.vocab_size * d
    emb = cfg.embedding
    if emb.embedding_type == "lev":
        lev = emb.lev
        h, ds, r = lev.num_heads, lev.seed_dim, lev.rank
        lev_fwd = 2 * h * ds * lev.seed_in_dim + 6 * h * ds * r + 2 * h * r * d
        input_flops = 4 * lev_fwd * unique_fraction  # forward, recompute, backward (2x)
    elif emb.embedding_type == "albert":
        input_flops = 6 * emb.albert_dim * d
    elif emb.embedding_type in ("flat-mlp", "factored-mlp"):
        seed = emb.flat_mlp_seed_dim or emb.lev.seed_in_dim
        input_flops = 6 * (seed * emb.mlp_hidden + emb.mlp_hidden * d)
    else:
        input_flops = 0
    passes = 4 if recompute else 3
    return passes * layers * layer_fwd + 3 * head_fwd + input_flops
