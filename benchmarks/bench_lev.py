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
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The repository root, so that `tests.support.memory` imports when this file runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def zipf_ids(vocab: int, n: int, exponent: float, seed: int) -> torch.Tensor:
    """n ids with P(rank k) ~ 1/k^exponent, ranks mapped to random ids (real vocabularies are
    not sorted by frequency)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks]


# The clock of every timing: wall time, or this process's CPU time (--clock cpu).
CLOCK = time.perf_counter


def best_time(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(reps):
        start = CLOCK()
        fn()
        best = min(best, CLOCK() - start)
    return best


def fwd_bwd(module, inputs):
    def run():
        for p in module.parameters():
            p.grad = None
        out = module(inputs)
        out.backward(torch.ones_like(out))

    return run


class LlamaLayer(torch.nn.Module):
    """One pre-norm LLaMA block: RMSNorm, rotary causal attention, RMSNorm, SwiGLU. [s, b, D]."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def _rotary(self, x):  # x [b, heads, s, hd]
        s, hd = x.shape[-2], x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    def forward(self, x):
        s, b, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, self.heads, -1).permute(2, 1, 3, 0, 4)
        att = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v, is_causal=True)
        x = x + self.proj(att.permute(2, 0, 1, 3).reshape(s, b, hidden))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def init_single_process():
    """A one-rank gloo world; returns its `ProcessGroups`."""
    from megatron_ext.launch import find_free_port
    from megatron_ext.parallel import initialize_parallel

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(find_free_port())
    return initialize_parallel(backend="gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--zipf-exponent", type=float, default=1.1)
    parser.add_argument("--naive-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-llama", action="store_true", help="skip (b) (slowest part)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the process's CPU time (steadier on a shared machine; run it with "
        "OMP_NUM_THREADS=1, else idle threads' spin-waiting counts too)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", "cpu", "torch", "triton"],
        help="--lev-kernel values to time for (a)/(b); the first one is used for (c) and (d)",
    )
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.lev import LEVConfig, LEVEmbedding
    from tests.support.memory import saved_tensor_bytes

    pg = init_single_process()
    torch.manual_seed(0)
    D, N = args.hidden_size, args.tokens
    b, s = N // args.seq_length, args.seq_length
    tc = TransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=16, use_cpu_initialization=True
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}; "
        f"D={D}, N={N} "
        f"({b}x{s}), Zipf exponent {args.zipf_exponent}",
        flush=True,
    )

    llama_time = None
    if not args.skip_llama:
        layer = LlamaLayer(D, 16, 5632)
        x = torch.randn(s, b, D, requires_grad=True)
        fwd_bwd(layer, x[:256])()  # warm-up on a short sequence
        start = CLOCK()
        fwd_bwd(layer, x)()
        llama_time = CLOCK() - start
        del layer, x
        print(f"LLaMA layer fwd+bwd: {llama_time:.2f} s", flush=True)

    for vocab in args.vocab_sizes:
        ids = zipf_ids(vocab, N, args.zipf_exponent, seed=vocab).view(b, s)
        distinct = ids.unique().numel()
        cfg = LEVConfig(vocab_size=vocab, hidden_size=D, kernel=args.kernels[0])
        lev = LEVEmbedding(cfg, config=tc)
        kernel_times = {}
        for kernel in args.kernels:
            lev.lev_config = dataclasses.replace(cfg, kernel=kernel)
            kernel_times[kernel] = best_time(fwd_bwd(lev, ids), args.reps)
        lev.lev_config = cfg
        t_lev = kernel_times[args.kernels[0]]

        table = VocabParallelEmbedding(
            vocab,
            D,
            init_method=torch.nn.init.normal_,
            config=tc,
            tp_group=pg.tp,
        )
        t_table = best_time(fwd_bwd(table, ids), args.reps)
        del table

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
            times[name] = best_time(fwd_bwd(lev, sub), args.reps)
        lev.lev_config = cfg

        print(
            f"\nV={vocab} (b={cfg.base}, {cfg.num_parameters() / 1e6:.2f}M LEV params): "
            f"{distinct} distinct ids in {N} tokens",
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
        print(
            f"  (d) on {sub.numel()} tokens ({sub.unique().numel()} distinct): naive "
            f"{times['naive']:.2f} s; speedup dedup {times['naive'] / times['dedup']:.2f}x, "
            f"fused {times['naive'] / times['fused']:.2f}x, fused+dedup "
            f"{times['naive'] / times['fused+dedup']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
