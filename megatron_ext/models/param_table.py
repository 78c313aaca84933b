"""``tools/count_params.py``: parameter and memory tables of arms x scales x vocabularies, from
the configuration alone (nothing is allocated). :func:`parameter_rows` counts parameters by part
with the overhead against TIED; :func:`memory_rows` plans per-GPU memory and training FLOPs per
token for a parallel layout (:mod:`megatron_ext.models.memory`).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

from megatron_ext.cli import run_tool
from megatron_ext.config.flags import ArgumentParser, add_flags, flag_values
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig, check_layout
from megatron_ext.config.lev import LEVConfig
from megatron_ext.config.model import (
    EMBEDDING_TYPES,
    MODEL_SIZE_PRESETS,
    EmbeddingConfig,
    ModelConfig,
)
from megatron_ext.config.run import BatchConfig, EngineConfig
from megatron_ext.models.memory import TrainingPlan, estimate_memory, flops_per_token
from megatron_ext.models.param_count import count_parameters, resolve_embedding_sizes

__all__ = [
    "COLUMNS",
    "MEMORY_COLUMNS",
    "PAPER_VOCAB_SIZES",
    "main",
    "memory_rows",
    "parameter_rows",
]

# o200k_base has 200,019 ids; Megatron pads vocabularies to a multiple of 128.
PAPER_VOCAB_SIZES = (50304, 100352, 200064)
COLUMNS = (
    "scale",
    "vocab",
    "arm",
    "total",
    "input_embedding",
    "output_head",
    "backbone",
    "overhead_vs_tied_pct",
    "arm_sizes",
)


def _arm_sizes(cfg: ModelConfig) -> str:
    emb = resolve_embedding_sizes(cfg, log=False).embedding
    if emb.embedding_type == "albert":
        return f"m={emb.albert_dim}"
    if emb.embedding_type == "flat-mlp":
        return f"d={emb.flat_mlp_seed_dim} H={emb.mlp_hidden}"
    if emb.embedding_type == "factored-mlp":
        return f"H={emb.mlp_hidden}"
    if emb.embedding_type == "lev":
        lev = emb.lev
        return f"k={lev.num_digits} b={lev.base} h={lev.num_heads} r={lev.rank}"
    return ""


def parameter_rows(
    scales: dict[str, dict[str, int]], vocab_sizes, arms, lev: dict | None = None
) -> list[dict]:
    """One row per scale x vocabulary x arm, with the overhead over TIED in percent; `lev`
    holds LEVConfig fields other than vocab_size/hidden_size (defaults where absent)."""
    rows = []
    for scale, shape in scales.items():
        for vocab in vocab_sizes:
            tied_total = None
            for arm in ("tied", *[a for a in arms if a != "tied"]):
                cfg = ModelConfig(
                    vocab_size=vocab,
                    embedding=EmbeddingConfig(embedding_type=arm, lev=dict(lev or {})),
                    **shape,
                )
                count = count_parameters(cfg)
                if arm == "tied":
                    tied_total = count.total
                if arm not in arms:
                    continue
                rows.append(
                    dict(
                        scale=scale,
                        vocab=vocab,
                        arm=arm,
                        total=count.total,
                        input_embedding=count.input_embedding,
                        output_head=count.output_head,
                        backbone=count.backbone,
                        overhead_vs_tied_pct=100.0 * (count.total - tied_total) / tied_total,
                        arm_sizes=_arm_sizes(cfg),
                    )
                )
    return rows


def _markdown(rows: list[dict]) -> str:
    """The parameter rows as a Markdown table."""
    head = "| scale | vocab | arm | total | input emb. | output head | backbone | vs TIED | sizes |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['scale']} | {r['vocab']:,} | {r['arm']} | {r['total'] / 1e6:,.2f}M | "
            f"{r['input_embedding'] / 1e6:,.3f}M | {r['output_head'] / 1e6:,.2f}M | "
            f"{r['backbone'] / 1e6:,.2f}M | {r['overhead_vs_tied_pct']:+.2f}% | {r['arm_sizes']} |"
        )
    return "\n".join(lines)


def _csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    """The rows as CSV with `columns` (floats to 4 decimals)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    return out.getvalue().rstrip("\n")


MEMORY_COLUMNS = (
    "scale",
    "vocab",
    "arm",
    "layout",
    "params_per_gpu",
    "weights_gib",
    "grads_gib",
    "optimizer_gib",
    "activations_gib",
    "activations_recompute_gib",
    "total_gib",
    "total_recompute_gib",
    "gflop_per_token",
)
_GIB = 1024**3
_GIB_COLUMNS = [c for c in MEMORY_COLUMNS if c.endswith("_gib")]


def memory_rows(
    scales: dict[str, dict[str, int]],
    vocab_sizes,
    arms,
    layout: TrainingPlan,
    seq_length: int,
    lev: dict | None = None,
) -> list[dict]:
    """One row per scale x vocabulary x arm: memory of the most loaded GPU, FLOPs per token."""
    p = layout.parallel
    name = (
        f"tp{p.tensor_model_parallel_size} pp{p.pipeline_model_parallel_size}"
        f" dp{p.data_parallel_size}{' sp' if p.sequence_parallel else ''}"
        f" mbs{layout.micro_batch_size} {'bf16' if layout.precision.bf16 else 'fp32'}"
        f" {layout.engine}{' distopt' if p.use_distributed_optimizer else ''}"
    )
    rows = []
    for scale, shape in scales.items():
        for vocab in vocab_sizes:
            for arm in arms:
                cfg = ModelConfig(
                    vocab_size=vocab,
                    seq_length=seq_length,
                    embedding=EmbeddingConfig(embedding_type=arm, lev=dict(lev or {})),
                    **shape,
                )
                check_layout(cfg, layout.parallel)
                mem = estimate_memory(cfg, layout)
                rows.append(
                    dict(
                        scale=scale,
                        vocab=vocab,
                        arm=arm,
                        layout=name,
                        params_per_gpu=mem.parameters,
                        **{c: getattr(mem, c.removesuffix("_gib")) / _GIB for c in _GIB_COLUMNS},
                        gflop_per_token=flops_per_token(cfg, False, layout.unique_fraction) / 1e9,
                    )
                )
    return rows


def _memory_markdown(rows: list[dict]) -> str:
    """The memory rows as a Markdown table (GiB)."""
    head = (
        "| scale | vocab | arm | layout | params/GPU | weights | grads | optim. | activ. | "
        "activ. (recompute) | total | total (recompute) | GFLOP/token |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        gib = [f"{r[k]:.2f} GiB" for k in _GIB_COLUMNS]
        lines.append(
            f"| {r['scale']} | {r['vocab']:,} | {r['arm']} | {r['layout']} | "
            f"{r['params_per_gpu'] / 1e6:,.1f}M | " + " | ".join(gib) + f" | "
            f"{r['gflop_per_token']:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags; the model's, LEV's and the layout's are the run's own fields (its
    plan's defaults where a plan's purpose differs: --seq-length, --bf16)."""
    parser = ArgumentParser(
        usage="%(prog)s [options]",
        description="Parameter counts of every arm x scale x vocabulary from the configuration\n"
        "alone (nothing is allocated); with --memory, per-GPU memory and training FLOPs of a\n"
        "parallel layout instead.",
    )
    parser.add_argument(
        "--format", choices=("markdown", "csv"), default="markdown", help="table format"
    )
    parser.add_argument(
        "--scales",
        nargs="+",
        choices=sorted(MODEL_SIZE_PRESETS),
        default=None,
        help="--model-size presets to count (default: all, or the shape the model flags give)",
    )
    parser.add_argument(
        "--vocab-sizes",
        nargs="+",
        type=int,
        default=list(PAPER_VOCAB_SIZES),
        help="vocabulary sizes to count",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=EMBEDDING_TYPES,
        default=list(EMBEDDING_TYPES),
        help="input-embedding arms to count",
    )
    group = parser.add_argument_group("memory", "per-GPU memory and FLOPs (--memory)")
    group.add_argument("--memory", action="store_true", help="print memory/FLOPs, not params")
    add_flags(group, ParallelConfig, "tensor_model_parallel_size", "pipeline_model_parallel_size")
    group.add_argument(
        "--data-parallel-size", type=int, default=1, help="data-parallel ranks of the plan"
    )
    add_flags(group, ParallelConfig, "sequence_parallel")
    add_flags(
        group, BatchConfig, "micro_batch_size", default=1, help="default 1 (training requires it)"
    )
    group.add_argument(
        "--num-micro-batches", type=int, default=None, help="per step per DP rank (default: PP)"
    )
    add_flags(
        group, ModelConfig, "seq_length", default=4096, help="default 4096 (training requires it)"
    )
    add_flags(
        group,
        PrecisionConfig,
        "bf16",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="BF16 activations (default: on, as GPU runs train; --no-bf16: float32)",
    )
    add_flags(group, ParallelConfig, "use_distributed_optimizer")
    add_flags(
        group,
        EngineConfig,
        "ddp_impl",
        help="portable: fp32 weights+grads under autocast; megatron: bf16 weights",
    )
    group.add_argument(
        "--unique-fraction",
        type=float,
        default=1.0,
        help="distinct ids per token in a micro-batch (LEV dedup; 1 = upper bound)",
    )
    shape = parser.add_argument_group("model", "a custom shape instead of the --scales presets")
    add_flags(shape, ModelConfig, *_SHAPE)
    add_flags(
        parser.add_argument_group("LEV", "LEV input generator (docs/lev.md section 2)"), LEVConfig
    )
    return parser


_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")


def _plan(args: argparse.Namespace) -> TrainingPlan:
    parallel = ParallelConfig(
        **flag_values(ParallelConfig, args), data_parallel_size=args.data_parallel_size
    )
    return TrainingPlan(
        parallel=parallel,
        precision=PrecisionConfig(bf16=args.bf16),
        micro_batch_size=args.micro_batch_size,
        num_micro_batches=args.num_micro_batches or parallel.pipeline_model_parallel_size,
        engine=args.ddp_impl,
        unique_fraction=args.unique_fraction,
    )


def main(argv=None) -> int:
    """``tools/count_params.py``: print the parameter (or, with --memory, memory) table."""
    return run_tool(_main, argv, log_format=None)


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    custom = {k: getattr(args, k) for k in _SHAPE if getattr(args, k) is not None}
    if custom and args.scales:
        parser.error("give either --scales or explicit size flags, not both")
    if custom:
        missing = {"num_layers", "hidden_size", "num_attention_heads"} - set(custom)
        if missing:
            parser.error("a custom shape needs --num-layers, --hidden-size, --num-attention-heads")
        scales = {"custom": custom}
    else:
        scales = {s: MODEL_SIZE_PRESETS[s] for s in (args.scales or MODEL_SIZE_PRESETS)}
    lev, markdown = flag_values(LEVConfig, args), args.format == "markdown"
    try:
        if args.memory:
            plan = _plan(args)
            rows = memory_rows(scales, args.vocab_sizes, args.arms, plan, args.seq_length, lev)
            print(_memory_markdown(rows) if markdown else _csv(rows, MEMORY_COLUMNS))
        else:
            rows = parameter_rows(scales, args.vocab_sizes, args.arms, lev)
            print(_markdown(rows) if markdown else _csv(rows, COLUMNS))
    except ValueError as err:
        print(f"count_params: error: {err}", file=sys.stderr)
        return 2
    return 0
