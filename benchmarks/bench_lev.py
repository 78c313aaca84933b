"""LEV speed and memory against the baselines it must not slow down.

For V = 50k and 200k, D = 2048, N = 8192 Zipf-distributed tokens, measured in this run:
(a) LEV fwd+bwd / VocabParallelEmbedding fwd+bwd; (b) LEV fwd+bwd / one LLaMA layer fwd+bwd,
per --kernels value; (c) LEV saved-activation bytes / bytes of the [N, D] output; (d) the
speed-up of dedup and of the fused path over plain autograd (on --naive-tokens tokens).
Times are the best of --reps runs after a warm-up. Run: `python benchmarks/bench_lev.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

# The repository root, so that `benchmarks.*` and `tests.support.memory` import when this file
# runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_ext.megatron_import  # noqa: E402, F401

from megatron.core.tensor_parallel import VocabParallelEmbedding  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    add_defaults,
    add_timing_flags,
    apply_timing_flags,
    repeat_seconds,
)
from benchmarks.plain_gpt import Block  # noqa: E402
from megatron_ext.inference.loading import init_inference_parallel  # noqa: E402
from megatron_ext.lev import LEVConfig, LEVEmbedding  # noqa: E402
from tests.support.memory import saved_tensor_bytes  # noqa: E402


def zipf_ids(vocab: int, n: int, exponent: float, seed: int) -> torch.Tensor:
    """n ids with P(rank k) ~ 1/k^exponent, ranks mapped to random ids (real vocabularies are
    not sorted by frequency)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks]


def fwd_bwd(module, inputs):
    def run():
        for p in module.parameters():
            p.grad = None
        out = module(inputs)
        out.backward(torch.ones_like(out))

    return run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[50_000, 200_000])
    add_defaults(parser, hidden_size=2048, tokens=8192, seq_length=2048, zipf_exponent=1.1)
    add_defaults(parser, naive_tokens=1024, reps=2)
    parser.add_argument("--skip-llama", action="store_true", help="skip (b) (slowest part)")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", "cpu", "torch", "triton"],
        help="--lev-kernel values to time for (a)/(b); the first one is used for (c) and (d)",
    )
    add_timing_flags(
        parser,
        "wall time, or the process's CPU time (steadier on a shared machine; run it with "
        "--threads 1, else idle threads' spin-waiting counts too)",
    )
    args = parser.parse_args()
    apply_timing_flags(parser, args)
    return args


def bench_vocab(args, vocab: int, tc, pg, llama_time) -> None:
    """(a)-(d) at vocabulary `vocab` (with `llama_time`, the LLaMA layer's seconds: (b))."""

    def best(module, inputs) -> float:
        return repeat_seconds(fwd_bwd(module, inputs), args.reps, 1, args.clock_fn, reduce=min)

    D, N = args.hidden_size, args.tokens
    ids = zipf_ids(vocab, N, args.zipf_exponent, seed=vocab).view(N // args.seq_length, -1)
    cfg = LEVConfig(vocab_size=vocab, hidden_size=D, kernel=args.kernels[0])
    lev = LEVEmbedding(cfg, config=tc)
    kernel_times = {}
    for kernel in args.kernels:
        lev.lev_config = dataclasses.replace(cfg, kernel=kernel)
        kernel_times[kernel] = best(lev, ids)
    t_lev = kernel_times[args.kernels[0]]
    table = VocabParallelEmbedding(
        vocab, D, init_method=torch.nn.init.normal_, config=tc, tp_group=pg.tp
    )
    t_table = best(table, ids)
    del table
    lev.lev_config = cfg
    saved, out = saved_tensor_bytes(functools.partial(lev, ids), exclude=lev.parameters())
    out_bytes = out.numel() * out.element_size()
    del out
    sub = ids.reshape(-1)[: args.naive_tokens].view(1, -1)
    times = {}
    for name, fused, dedup in [
        ("naive", False, False),
        ("dedup", False, True),
        ("fused", True, False),
        ("fused+dedup", True, True),
    ]:
        kernel = cfg.kernel if fused else "reference"
        lev.lev_config = dataclasses.replace(cfg, kernel=kernel, dedup=dedup)
        times[name] = best(lev, sub)
    print(
        f"\nV={vocab} (b={cfg.base}, {cfg.num_parameters() / 1e6:.2f}M LEV params): "
        f"{ids.unique().numel()} distinct ids in {N} tokens",
        flush=True,
    )
    print(
        "  LEV fwd+bwd "
        + ", ".join(f"{s:.3f} s [{k}]" for k, s in kernel_times.items())
        + f"; VocabParallelEmbedding fwd+bwd {t_table:.3f} s"
    )
    print(f"  (a) LEV / VocabParallelEmbedding          = {t_lev / t_table:.2f}")
    if llama_time is not None:
        for kernel, seconds in kernel_times.items():
            label = f"(b) LEV / LLaMA layer [--lev-kernel {kernel}]"
            print(f"  {label:42s}= {seconds / llama_time:.3f}   (target <= 0.03)")
    print(
        f"  (c) LEV saved activations / [N, D] output = {saved / out_bytes:.3f}"
        f"   ({saved / 2**20:.1f} MiB / {out_bytes / 2**20:.1f} MiB, target <= 2.0)"
    )
    naive = times["naive"]
    print(
        f"  (d) on {sub.numel()} tokens ({sub.unique().numel()} distinct): naive "
        f"{naive:.2f} s; speedup dedup {naive / times['dedup']:.2f}x, "
        f"fused {naive / times['fused']:.2f}x, fused+dedup {naive / times['fused+dedup']:.2f}x",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    pg = init_inference_parallel(1, 1)
    torch.manual_seed(0)
    D, N, s = args.hidden_size, args.tokens, args.seq_length
    tc = TransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=16, use_cpu_initialization=True
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}; "
        f"D={D}, N={N} ({N // s}x{s}), Zipf exponent {args.zipf_exponent}",
        flush=True,
    )
    llama_time = None
    if not args.skip_llama:  # one pre-norm LLaMA block at the 1.2B width, [b, s, D]
        layer = Block(D, 16, 5632, rope=True)
        x = torch.randn(N // s, s, D, requires_grad=True)
        fwd_bwd(layer, x[:, :256])()  # warm-up on a short sequence
        llama_time = repeat_seconds(fwd_bwd(layer, x), 1, 0, args.clock_fn)
        del layer, x
        print(f"LLaMA layer fwd+bwd: {llama_time:.2f} s", flush=True)
    for vocab in args.vocab_sizes:
        bench_vocab(args, vocab, tc, pg, llama_time)


if __name__ == "__main__":
    main()
