"""Model flags (Megatron-LM names) and the `ModelConfig` they fill.

Size flags default to None so that `--model-size` presets fill what the user did not set;
any explicit Megatron size flag overrides the preset value.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron_ext.lev.arguments import add_lev_arguments, lev_config_from_args
from megatron_ext.models.config import (
    EMBEDDING_TYPES,
    MODEL_SIZE_PRESETS,
    TRANSFORMER_IMPLS,
    EmbeddingConfig,
    ModelConfig,
)
from megatron_ext.models.layer_specs import transformer_engine_available

__all__ = ["add_model_arguments", "model_config_from_args"]

# Debug flavour used when neither a preset nor explicit sizes are given (tiny, CPU friendly).
_DEBUG_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the model, embedding-arm, Megatron-LM compatibility and --lev-* flags; return parser."""
    group = parser.add_argument_group("model", "LLaMA-style backbone and input embedding")
    group.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZE_PRESETS),
        default=None,
        help="preset depth/width/heads/FFN for the paper's scales (explicit flags override)",
    )
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--ffn-hidden-size", type=int, default=None)
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument(
        "--group-query-attention", action="store_true", help="use --num-query-groups KV heads"
    )
    group.add_argument("--num-query-groups", type=int, default=None)
    group.add_argument("--seq-length", type=int, default=None)
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="accepted for Megatron compatibility; rotary positions need no table",
    )
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--hidden-dropout", type=float, default=0.0)
    group.add_argument("--attention-dropout", type=float, default=0.0)
    group.add_argument("--qk-layernorm", action="store_true")
    group.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        # Megatron-LM's default where it can run; the CPU path elsewhere.
        default="transformer_engine" if transformer_engine_available() else "local",
        help="transformer_engine (TE on CUDA) or local (megatron-core modules with CPU twins); "
        "default: transformer_engine where TE and a GPU are present, else local",
    )
    group.add_argument(
        "--use-cpu-initialization",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="initialise weights on CPU from one seeded stream (identical at every TP size)",
    )
    group.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    group.add_argument("--recompute-num-layers", type=int, default=None)

    emb = parser.add_argument_group("embedding", "input embedding arm (docs/lev.md section 3)")
    emb.add_argument("--embedding-type", choices=EMBEDDING_TYPES, default="lev")
    emb.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Megatron-LM's flag; every arm but 'tied' is untied already, so it only "
        "conflicts with --embedding-type tied",
    )
    emb.add_argument("--albert-dim", type=int, default=None, help="ALBERT's m (default: match LEV)")
    emb.add_argument(
        "--flat-mlp-seed-dim", type=int, default=None, help="FLAT-MLP table width (default: match)"
    )
    emb.add_argument(
        "--embedding-mlp-hidden",
        type=int,
        default=None,
        help="hidden width of the FLAT-MLP / FACTORED-MLP networks (default: match LEV)",
    )
    _add_megatron_compatibility_arguments(parser)
    add_lev_arguments(parser)
    return parser


def _add_megatron_compatibility_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of Megatron-LM GPT launch scripts that restate this backbone's fixed design.

    They are accepted so that existing scripts run unchanged; a value that asks for another
    design (LayerNorm, learned positions) is refused in `model_config_from_args`.
    """
    compat = parser.add_argument_group(
        "Megatron-LM compatibility", "accepted for launch-script reuse; the backbone is LLaMA-style"
    )
    for flag, help_ in (
        ("--use-mcore-models", "always: models are megatron-core GPTModels"),
        ("--swiglu", "always: the MLP is SwiGLU"),
        ("--disable-bias-linear", "always: linear layers have no bias"),
        ("--attention-softmax-in-fp32", "always: softmax runs in fp32"),
        ("--use-flash-attn", "Transformer Engine picks its fused attention itself"),
        ("--no-masked-softmax-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-bias-swiglu-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-bias-dropout-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-rope-fusion", "the local path runs no fusions; TE fuses on its own"),
        ("--no-gradient-accumulation-fusion", "gradients accumulate in fp32 main grads"),
    ):
        compat.add_argument(flag, action="store_true", help=help_)
    compat.add_argument("--normalization", default="RMSNorm", help="only RMSNorm")
    compat.add_argument("--position-embedding-type", default="rope", help="only rope")


def _check_fixed_design(args: argparse.Namespace) -> None:
    if getattr(args, "normalization", "RMSNorm") != "RMSNorm":
        raise ValueError(
            f"--normalization {args.normalization}: the Leviathan backbone is LLaMA-style and "
            "uses RMSNorm; drop the flag"
        )
    if getattr(args, "position_embedding_type", "rope") != "rope":
        raise ValueError(
            f"--position-embedding-type {args.position_embedding_type}: the Leviathan backbone "
            "uses rotary positions; drop the flag"
        )


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """Fill a ModelConfig from parsed flags; `vocab_size` is the padded vocabulary.

    The `--lev-*` flags become the frozen `LEVConfig` at `embedding.lev` (for the arms that use
    LEV; `lev.arguments.lev_config_from_args`), the object the model hands to `LEVEmbedding`.
    """
    _check_fixed_design(args)
    if args.embedding_type == "tied" and getattr(args, "untie_embeddings_and_output_weights"):
        raise ValueError(
            "--untie-embeddings-and-output-weights contradicts --embedding-type tied; drop one"
        )
    sizes = dict(MODEL_SIZE_PRESETS[args.model_size]) if args.model_size else {}
    if not sizes and all(
        getattr(args, k) is None for k in ("num_layers", "hidden_size", "num_attention_heads")
    ):
        sizes = dict(_DEBUG_MODEL)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in sizes]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise ValueError(f"set {flags} or pick a --model-size preset")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    embedding = EmbeddingConfig(
        embedding_type=args.embedding_type,
        albert_dim=args.albert_dim,
        flat_mlp_seed_dim=args.flat_mlp_seed_dim,
        mlp_hidden=args.embedding_mlp_hidden,
    )
    if embedding.uses_lev:
        lev = lev_config_from_args(args, vocab_size, sizes["hidden_size"])
        embedding = dataclasses.replace(embedding, lev=lev)
    params_dtype = torch.float32
    # Without --seq-length (a tool building the model alone): ModelConfig's own default.
    seq = {} if args.seq_length is None else {"seq_length": args.seq_length}
    return ModelConfig(
        vocab_size=vocab_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        head_dim=getattr(args, "kv_channels", None),
        norm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        qk_layernorm=args.qk_layernorm,
        transformer_impl=args.transformer_impl,
        embedding=embedding,
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        sequence_parallel=getattr(args, "sequence_parallel", False),
        params_dtype=params_dtype,
        bf16=getattr(args, "bf16", False),
        fp16=getattr(args, "fp16", False),
        fp8=getattr(args, "fp8_format", None),
        use_cpu_initialization=args.use_cpu_initialization,
        # Megatron-LM: --recompute-activations means selective recomputation.
        recompute_granularity=args.recompute_granularity
        or ("selective" if getattr(args, "recompute_activations", False) else None),
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        **sizes,
        **seq,
    )
