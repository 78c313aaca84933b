"""What a model is built *at*, apart from what it *is*: the parallel layout (`ModelParallelism`)
and the parameter precision (`ModelPrecision`), the cross-checks that need them with the
model's shapes (`check_layout`), and megatron's `TransformerConfig` composed from the three
(`compose_transformer_config`).

`ModelConfig` describes the model only; `build_model(model_cfg, parallel=..., precision=...)`
applies the layout afterwards, as torchtitan's `parallelize_llama(model, parallel_dims, ...)`.
The run's `training.config.ParallelConfig` has the same four layout fields (and the flags), so
it can be passed as `parallel` directly; the model's precision is the engine's choice
(`training.gpu_arguments.engine_model_precision`), not the run's autocast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_ext.models.config import FP8_FORMATS, ModelConfig, check_half_precision

__all__ = [
    "FP8_FORMATS",
    "ModelParallelism",
    "ModelPrecision",
    "check_layout",
    "compose_transformer_config",
]


@dataclass(frozen=True)
class ModelParallelism:
    """How the model's weights and activations are split: the model side of
    `training.config.ParallelConfig` (same field names, whose flags they are)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type != "bool" and value < 1:
                raise ValueError(f"--{f.name.replace('_', '-')} must be >= 1, got {value}")

    @classmethod
    def of(cls, parallel: Any) -> "ModelParallelism":
        """The model layout of `parallel`: a ModelParallelism, or any object with its fields
        (a `ParallelConfig`, an args.json namespace); None is one rank."""
        if parallel is None or isinstance(parallel, cls):
            return parallel or cls()
        return cls(**{f.name: getattr(parallel, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ModelPrecision:
    """The dtype the parameters are built in and megatron's mixed-precision switches.

    The portable engine builds float32 parameters whatever --bf16/--fp16 say (it runs them as
    autocast, `training.precision`); --ddp-impl megatron builds BF16 parameters. `fp8_margin`,
    `fp8_amax_history_len`, `fp8_amax_compute_algo`: the FP8 recipe megatron's engine passes
    to Transformer Engine (None: TransformerConfig's defaults).
    """

    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    fp8_format: Optional[str] = None
    """FP8 recipe format ('hybrid' or 'e4m3'), Transformer Engine only (--fp8-format)."""
    fp8_margin: Optional[int] = None
    fp8_amax_history_len: Optional[int] = None
    fp8_amax_compute_algo: Optional[str] = None

    def __post_init__(self) -> None:
        check_half_precision(self.bf16, self.fp16)
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"--fp8-format must be hybrid or e4m3, got {self.fp8_format!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: bfloat16 with bf16, float16 with fp16, else params_dtype."""
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return self.params_dtype


def check_layout(
    model_cfg: ModelConfig, parallel: Any = None, precision: Optional[ModelPrecision] = None
) -> None:
    """Raise ValueError, naming the flag to change, where the model cannot be built at this
    layout and precision: sizes the tensor- or pipeline-parallel size must divide, sequence
    and context parallelism's needs, LEV's heads per TP rank, FP8's Transformer Engine.

    `parallel`: a `ModelParallelism` or a `ParallelConfig` (None: one rank); `precision`:
    None is float32.
    """
    parallel = ModelParallelism.of(parallel)
    precision = precision or ModelPrecision()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if model_cfg.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {model_cfg.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; change one of them"
        )
    if model_cfg.num_query_groups % tp:
        raise ValueError(
            f"--num-query-groups {model_cfg.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; change one of them"
        )
    if model_cfg.ffn_hidden_size % tp:
        raise ValueError(
            f"--ffn-hidden-size {model_cfg.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if model_cfg.num_layers % pp:
        raise ValueError(
            f"--num-layers {model_cfg.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size {pp}; change one of them"
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
    if model_cfg.embedding.embedding_type == "lev":
        model_cfg.embedding.lev.heads_per_rank(tp)  # LEV splits its heads over TP
    impl = model_cfg.transformer_impl
    if parallel.context_parallel_size > 1 and impl != "transformer_engine":
        raise ValueError(
            "--context-parallel-size > 1 needs --transformer-impl transformer_engine "
            "(megatron-core's context-parallel attention is Transformer Engine's)"
        )
    if precision.fp8_format is not None and impl != "transformer_engine":
        raise ValueError(
            "--fp8-format needs --transformer-impl transformer_engine on a CUDA GPU; "
            "FP8 is not available on CPU"
        )


def compose_transformer_config(
    model_cfg: ModelConfig, parallel: Any = None, precision: Optional[ModelPrecision] = None
):
    """megatron-core's `TransformerConfig` of `model_cfg` built at `parallel` and `precision`
    (checked by `check_layout` first); `model_cfg.extra_transformer_config` is applied last."""
    # megatron.core on first use: `megatron_ext.models` keeps the configs importable without
    # it (its megatron-core modules are lazy exports, megatron_ext/_lazy.py).
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.transformer import TransformerConfig

    parallel = ModelParallelism.of(parallel)
    precision = precision or ModelPrecision()
    check_layout(model_cfg, parallel, precision)
    dtype = precision.dtype
    fp8_recipe = {
        name: getattr(precision, name)
        for name in ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
        if getattr(precision, name) is not None
    }
    kwargs = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        kv_channels=model_cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=model_cfg.hidden_dropout,
        attention_dropout=model_cfg.attention_dropout,
        init_method_std=model_cfg.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=precision.bf16,
        fp16=precision.fp16,
        pipeline_dtype=dtype,
        fp8=precision.fp8_format,
        use_cpu_initialization=model_cfg.use_cpu_initialization,
        perform_initialization=model_cfg.perform_initialization,
        recompute_granularity=model_cfg.recompute_granularity,
        recompute_method=model_cfg.recompute_method,
        recompute_num_layers=model_cfg.recompute_num_layers,
        # Fusions that need apex or CUDA kernels stay off; TE fuses on its own.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **fp8_recipe,
    )
    kwargs.update(model_cfg.extra_transformer_config)
    return TransformerConfig(**kwargs)
