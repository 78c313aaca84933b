#!/usr/bin/env python
"""Parameter table of every arm x scale x vocabulary, from the configuration alone.

Nothing is allocated, so the 1.2B rows are instant. Example:

    python tools/count_params.py                       # Markdown, all arms/scales/vocabs
    python tools/count_params.py --format csv --scales 1.2b --vocab-sizes 200064
    python tools/count_params.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 \\
        --vocab-sizes 32000                            # a custom shape instead of presets
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

from megatron_ext.models import (
    EMBEDDING_TYPES,
    MODEL_SIZE_PRESETS,
    EmbeddingConfig,
    ModelConfig,
    count_parameters,
)
from megatron_ext.models.param_count import resolve_embedding_sizes

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
        lev = cfg.lev_config()
        return f"k={lev.num_digits} b={lev.base} h={lev.num_heads} r={lev.rank}"
    return ""


def parameter_rows(
    scales: dict[str, dict[str, int]], vocab_sizes, arms, lev: dict | None = None
) -> list[dict]:
    """One row per scale x vocabulary x arm, with the overhead over TIED in percent."""
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


def to_markdown(rows: list[dict]) -> str:
    head = "| scale | vocab | arm | total | input emb. | output head | backbone | vs TIED | sizes |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['scale']} | {r['vocab']:,} | {r['arm']} | {r['total'] / 1e6:,.2f}M | "
            f"{r['input_embedding'] / 1e6:,.3f}M | {r['output_head'] / 1e6:,.2f}M | "
            f"{r['backbone'] / 1e6:,.2f}M | {r['overhead_vs_tied_pct']:+.2f}% | {r['arm_sizes']} |"
        )
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({**r, "overhead_vs_tied_pct": f"{r['overhead_vs_tied_pct']:.4f}"})
    return out.getvalue().rstrip("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("markdown", "csv"), default="markdown")
    parser.add_argument("--scales", nargs="+", choices=sorted(MODEL_SIZE_PRESETS), default=None)
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=list(PAPER_VOCAB_SIZES))
    parser.add_argument("--arms", nargs="+", choices=EMBEDDING_TYPES, default=list(EMBEDDING_TYPES))
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--num-query-groups", type=int)
    parser.add_argument("--ffn-hidden-size", type=int)
    parser.add_argument("--lev-num-heads", type=int)
    parser.add_argument("--lev-rank", type=int)
    parser.add_argument("--lev-seed-dim", type=int)
    parser.add_argument("--lev-num-knots", type=int)
    parser.add_argument("--lev-num-digits", type=int)
    args = parser.parse_args(argv)

    custom = {
        k: getattr(args, k)
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
        )
        if getattr(args, k) is not None
    }
    if custom and args.scales:
        parser.error("give either --scales or explicit size flags, not both")
    if custom:
        missing = {"num_layers", "hidden_size", "num_attention_heads"} - set(custom)
        if missing:
            parser.error("a custom shape needs --num-layers, --hidden-size, --num-attention-heads")
        scales = {"custom": custom}
    else:
        scales = {s: MODEL_SIZE_PRESETS[s] for s in (args.scales or MODEL_SIZE_PRESETS)}
    lev = {
        field: getattr(args, f"lev_{field}")
        for field in ("num_heads", "rank", "seed_dim", "num_knots", "num_digits")
        if getattr(args, f"lev_{field}") is not None
    }
    try:
        rows = parameter_rows(scales, args.vocab_sizes, args.arms, lev)
    except ValueError as err:
        print(f"count_params: error: {err}", file=sys.stderr)
        return 2
    print(to_markdown(rows) if args.format == "markdown" else to_csv(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
