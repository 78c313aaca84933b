"""Statistics of LEV's initial [V, D] embedding table next to a N(0, 0.02) lookup table: std,
mean pairwise cosine between tokens, and the share of the energy in the mean embedding.

    python benchmarks/lev_init_stats.py            # docs/lev-training.md's sizes
    python benchmarks/lev_init_stats.py --vocab-size 50304 --hidden-size 768 --seed-dim 128 \\
        --rank 64 --num-heads 8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def describe(table: torch.Tensor, pairs: torch.Tensor) -> str:
    """One line of statistics of a [V, D] table."""
    unit = F.normalize(table, dim=-1)
    cosine = (unit[pairs[0]] * unit[pairs[1]]).sum(-1).mean()
    mean_share = table.mean(0).norm() ** 2 / table.pow(2).sum(-1).mean()
    return (
        f"std {table.std():.4f}  mean pairwise cosine {cosine:.3f}  "
        f"share of |e|^2 in the mean embedding {mean_share:.3f}"
    )


def main() -> None:
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.transformer import TransformerConfig

    from megatron_ext.lev import LEVConfig, LEVEmbedding

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", type=int, default=8064)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--seed-dim", type=int, default=64)
    p.add_argument("--num-knots", type=int, default=16)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--output-std", type=float, default=0.02, help="--lev-init-output-std shown")
    args = p.parse_args()
    tc = TransformerConfig(
        num_layers=1, hidden_size=args.hidden_size, num_attention_heads=1,
        use_cpu_initialization=True,
    )  # fmt: skip
    ids = torch.arange(args.vocab_size).view(1, -1)
    pairs = torch.randint(
        0, args.vocab_size, (2, 20000), generator=torch.Generator().manual_seed(0)
    )
    for name, std in (
        ("spec init", None),
        (f"--lev-init-output-std {args.output_std}", args.output_std),
    ):
        cfg = LEVConfig(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, seed_dim=args.seed_dim,
            num_knots=args.num_knots, rank=args.rank, num_heads=args.num_heads,
            init_output_std=std,
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.no_grad():
            table = LEVEmbedding(cfg, config=tc)(ids)[0]
        print(f"{name:28s} {describe(table, pairs)}")
    table = torch.empty(args.vocab_size, args.hidden_size).normal_(0.0, 0.02)
    print(f"{'lookup table N(0, 0.02)':28s} {describe(table, pairs)}")


if __name__ == "__main__":
    main()
