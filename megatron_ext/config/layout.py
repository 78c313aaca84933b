"""What a model is built and trained *at*: the parallel layout (`ParallelConfig`) and precision
(`PrecisionConfig`), with their flags, and `check_layout`, what they need of the model's shapes.
`ModelConfig` describes the model only; `build_model(model_cfg, parallel=..., precision=...)`
applies the layout afterwards, as torchtitan's `parallelize_llama(model, parallel_dims, ...)`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config.flags import flag, flag_dataclass
from megatron_ext.config.model import ModelConfig

__all__ = [
    "ParallelConfig",
    "PrecisionConfig",
    "check_layout",
]


@flag_dataclass
class ParallelConfig:
    """Process layout: TP x CP x PP x DP ranks (DP is derived from the world size)."""

    tensor_model_parallel_size: int = flag(1, "ranks that split each layer's matrices", minimum=1)
    pipeline_model_parallel_size: int = flag(1, "ranks that split the layers", minimum=1)
    context_parallel_size: int = flag(1, "ranks that split the sequence in attention", minimum=1)
    sequence_parallel: bool = flag(
        False, "split norm/dropout activations over the sequence across TP ranks"
    )
    use_distributed_optimizer: bool = flag(
        False, "shard optimizer states across data-parallel ranks (ZeRO-1)"
    )
    distributed_backend: Optional[str] = flag(
        None, "default: nccl on CUDA, gloo on CPU", choices=("nccl", "gloo")
    )
    distributed_timeout_minutes: float = flag(
        10,
        "how long a collective may wait for the other ranks (fractions allowed: 0.1 = 6 s)",
        above=0,
    )
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        None,
        "layers per model chunk: each pipeline rank runs num-layers / (PP x N) chunks with "
        "the interleaved 1F1B schedule (portable engine)",
        minimum=1,
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        None,
        "model chunks per pipeline rank (Megatron-LM's other spelling of the interleaved "
        "schedule: sets --num-layers-per-virtual-pipeline-stage to num-layers / (PP x N))",
        minimum=1,
    )
    data_parallel_size: int = 1
    """Derived: world size / (TP x CP x PP), set by `resolve`."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Derived: model chunks per pipeline rank, num-layers / (PP x
    num_layers_per_virtual_pipeline_stage), set by `with_num_layers` (None: one chunk)."""

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data-parallel size must be >= 1, got {self.data_parallel_size}")
        if self.num_layers_per_virtual_pipeline_stage and self.num_virtual_stages_per_pipeline_rank:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-"
                "rank cannot be set at the same time (both set the model chunks per pipeline "
                "rank); keep one of them"
            )
        for name, value in (
            ("--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage),
            ("--num-virtual-stages-per-pipeline-rank", self.num_virtual_stages_per_pipeline_rank),
        ):
            if value and self.pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"{name} needs --pipeline-model-parallel-size > 1 (the interleaved schedule "
                    "splits each pipeline rank's layers into chunks); drop the flag or raise PP"
                )

    def with_num_layers(self, num_layers: int) -> "ParallelConfig":
        """This layout for a `num_layers` model, the model chunks per pipeline rank derived (self
        if they are; one stage per rank is no interleaving, as in Megatron-LM). ValueError:
        `num_layers` is not divisible by PP x the chunks' layers."""
        pp, stages = self.pipeline_model_parallel_size, self.num_virtual_stages_per_pipeline_rank
        per_stage = self.num_layers_per_virtual_pipeline_stage
        if stages is not None:
            name, n = "--num-virtual-stages-per-pipeline-rank", stages
        else:
            name, n = "--num-layers-per-virtual-pipeline-stage", per_stage
        if n is not None and num_layers % (pp * n):
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} x {name} {n} = {pp * n}; change one of them"
            )
        if stages is not None:
            per_stage = None if stages == 1 else num_layers // (pp * stages)
        derived = dataclasses.replace(
            self,
            num_layers_per_virtual_pipeline_stage=per_stage,
            num_virtual_stages_per_pipeline_rank=None,
            virtual_pipeline_model_parallel_size=per_stage and num_layers // (pp * per_stage),
        )
        return self if derived == self else derived

    @property
    def _model_parallel(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def world_size(self) -> int:
        """TP x CP x PP x DP ranks."""
        return self._model_parallel * self.data_parallel_size

    def resolve(self, world_size: int) -> "ParallelConfig":
        """This layout on `world_size` ranks, the data-parallel size derived (self if it is);
        ValueError: the ranks do not split into TP x CP x PP x DP."""
        if world_size % self._model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
                f"size {self.tensor_model_parallel_size}x{self.pipeline_model_parallel_size}x"
                f"{self.context_parallel_size}={self._model_parallel}; change --nproc-per-node or "
                "the parallel sizes"
            )
        dp = world_size // self._model_parallel
        if dp == self.data_parallel_size:
            return self
        return dataclasses.replace(self, data_parallel_size=dp)


@flag_dataclass
class PrecisionConfig:
    """The run's precision: the parameters' dtype, the portable engine's autocast, the FP8
    recipe (Transformer Engine) and FP16 loss scaling (see `training/precision.py`)."""

    bf16: bool = flag(False, "BF16 autocast (fp32 master weights)")
    fp16: bool = flag(False, "FP16 autocast with dynamic loss scaling")
    fp8_format: Optional[str] = flag(
        None,
        "FP8 GEMMs through Transformer Engine (CUDA only; with --bf16)",
        choices=("e4m3", "hybrid"),
    )
    fp8_margin: int = flag(0, "FP8 scaling margin (DelayedScaling)", needs="fp8_format")
    fp8_amax_history_len: int = flag(
        1, "amax history length of FP8 delayed scaling", minimum=1, needs="fp8_format"
    )
    fp8_amax_compute_algo: str = flag(
        "most_recent", "amax from the history", choices=("most_recent", "max")
    )
    fp8_param_gather: bool = flag(
        False,
        "keep FP8 weights and all-gather them in FP8 (megatron-core's distributed optimizer: "
        "--ddp-impl megatron --use-distributed-optimizer with --fp8-format)",
    )
    loss_scale: Optional[float] = flag(None, "static FP16 loss scale")
    initial_loss_scale: float = flag(2.0**32, "first dynamic FP16 loss scale")
    min_loss_scale: float = flag(1.0, "least dynamic FP16 loss scale")
    loss_scale_window: int = flag(1000, "finite steps before the loss scale grows")
    hysteresis: int = flag(2, "overflows tolerated before the loss scale shrinks")
    grad_reduce_in_bf16: bool = flag(False, "all-reduce data-parallel gradients in bfloat16")
    params_dtype: str = "float32"
    """The parameters' dtype (a torch dtype or its name): float32 under the portable engine's
    autocast; bfloat16 with --bf16 under --ddp-impl megatron (`RunConfig` derives it)."""

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are exclusive; pick one")
        if self.fp8_format is not None and not (self.bf16 or self.fp16):
            raise ValueError("--fp8-format needs --bf16 (FP8 hybrid runs other ops in BF16)")

    def fp8_recipe(self) -> dict:
        """The DelayedScaling keywords of the FP8 recipe (margin, amax history and algorithm)."""
        return dict(
            margin=self.fp8_margin,
            amax_history_len=self.fp8_amax_history_len,
            amax_compute_algo=self.fp8_amax_compute_algo,
        )


def check_layout(
    model_cfg: ModelConfig,
    parallel: Optional[ParallelConfig] = None,
    precision: Optional[PrecisionConfig] = None,
) -> None:
    """Raise ValueError, naming the flag to change, where the model cannot be built at this
    layout and precision (None: one rank, float32): sizes the tensor- or pipeline-parallel size
    must divide, sequence and context parallelism's needs, LEV's heads per TP rank, FP8's
    Transformer Engine."""
    parallel, precision = parallel or ParallelConfig(), precision or PrecisionConfig()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    change = "; change one of them"
    for name, value, size, kind, fix in (
        ("--num-attention-heads", model_cfg.num_attention_heads, tp, "tensor", change),
        ("--num-query-groups", model_cfg.num_query_groups, tp, "tensor", change),
        ("--ffn-hidden-size", model_cfg.ffn_hidden_size, tp, "tensor", ""),
        ("--num-layers", model_cfg.num_layers, pp, "pipeline", change),
    ):
        if value % size:
            raise ValueError(
                f"{name} {value} is not divisible by --{kind}-model-parallel-size {size}{fix}"
            )
    if parallel.sequence_parallel and tp == 1:
        raise ValueError(
            "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the "
            "sequence across tensor-parallel ranks); drop the flag or raise TP"
        )
    if parallel.sequence_parallel and model_cfg.seq_length % tp:
        raise ValueError(
            f"--seq-length {model_cfg.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{tp}, which --sequence-parallel needs; change the sequence length"
        )
    cp = parallel.context_parallel_size
    if cp > 1 and model_cfg.seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {model_cfg.seq_length} is not divisible by 2 x --context-parallel-size "
            f"{cp}"
        )
    if model_cfg.embedding.embedding_type == "lev":
        model_cfg.embedding.lev.heads_per_rank(tp)  # LEV splits its heads over TP
    impl = model_cfg.transformer_impl
    if cp > 1 and impl != "transformer_engine":
        raise ValueError(
            f"--context-parallel-size {cp} needs --transformer-impl "
            "transformer_engine on a CUDA GPU (megatron-core's context-parallel attention is "
            "Transformer Engine's); without one, pass --context-parallel-size 1"
        )
    if precision.fp8_format is not None and impl != "transformer_engine":
        raise ValueError(
            "--fp8-format needs --transformer-impl transformer_engine on a CUDA GPU; "
            "FP8 is not available on CPU"
        )
