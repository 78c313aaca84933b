"""Generation and export speed, each against a baseline of this run (compare the ratios):

(a) `generate` with the KV cache / recomputing the whole prefix at every step (>> 1)
(b) materialising the LEV table at V = --table-vocab, D = --table-hidden / writing that
    table as safetensors (target <= 1)
(c) `generate` (as tools/generate.py) / transformers' `generate` on our HF export, at each
    of --peer-batches, --pairs interleaved runs: min and median ratio, and whether every
    pair gave the same tokens (target >= 1.2 at batch 1)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    add_defaults,
    add_timing_flags,
    apply_timing_flags,
    comparison,
    interleave,
    timed,
)


def _bench_model(args, pg):
    from benchmarks.hf_peer import bench_model

    return bench_model(
        pg, vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
        num_attention_heads=args.heads, seq_length=args.prompt_tokens + args.new_tokens,
    )  # fmt: skip


def bench_kv_cache(args, pg) -> None:
    from megatron_ext.inference.generation import SamplingConfig, generate

    _, model = _bench_model(args, pg)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens)).tolist()
    results = {}
    for use_cache in (True, False):
        cfg = SamplingConfig(max_new_tokens=args.new_tokens, use_cache=use_cache)
        warm_up = SamplingConfig(max_new_tokens=4, use_cache=use_cache)
        generate(model, prompts, warm_up, tp_group=pg.tp)
        out, seconds = timed(lambda: generate(model, prompts, cfg, tp_group=pg.tp), args.clock_fn)
        results[use_cache] = (out, sum(len(o) for o in out) / seconds, seconds)
    same = results[True][0] == results[False][0]
    print(
        f"(a) {args.new_tokens} new tokens, prompt {args.prompt_tokens}, batch {args.batch}, "
        f"{args.layers} layers x D {args.hidden}, V {args.vocab}:\n"
        f"    KV cache {results[True][1]:8.1f} tokens/s ({results[True][2]:.1f} s)\n"
        f"    recompute {results[False][1]:7.1f} tokens/s ({results[False][2]:.1f} s)\n"
        f"    ratio {results[True][1] / results[False][1]:.1f}x   (same tokens: {same})"
    )


def bench_vs_transformers(args, pg) -> None:
    from benchmarks.hf_peer import hf_export
    from megatron_ext.inference.generation import SamplingConfig, decode_step_for, generate

    config, model = _bench_model(args, pg)
    step = args.step if args.step != "auto" else decode_step_for(model)[0]
    hf = hf_export(model, config)
    n = args.new_tokens
    for batch in args.peer_batches:
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_tokens))
        cfg = SamplingConfig(max_new_tokens=n)

        def ours():
            return generate(model, prompts.tolist(), cfg, tp_group=pg.tp, step=step)

        def theirs():
            with torch.inference_mode():
                out = hf.generate(
                    prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                )  # fmt: skip
            return out[:, args.prompt_tokens :].tolist()

        ours(), theirs()  # warm-up
        runs = interleave(args.pairs, ours, theirs, args.clock_fn)
        same = all(a == b for a, _, b, _ in runs)
        rates = {
            f"ours ({step} step)": [batch * n / t for _, t, _, _ in runs],
            "transformers generate ": [batch * n / t for _, _, _, t in runs],
        }
        print(
            f"(c) greedy, {n} new tokens, prompt {args.prompt_tokens}, batch {batch}, "
            f"{args.layers} layers x D {args.hidden}, V {args.vocab}, {args.pairs} pairs:\n"
            + comparison(rates, [t / o for _, o, _, t in runs], f"   (same tokens: {same})", 8, 1)
        )


def bench_table(args) -> None:
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.transformer import TransformerConfig
    from safetensors.torch import save_file

    from megatron_ext.conversion.source import materialize_module_table
    from megatron_ext.lev import LEVConfig, LEVEmbedding

    torch.manual_seed(0)
    V, D = args.table_vocab, args.table_hidden
    lev_config = LEVConfig(vocab_size=V, hidden_size=D)
    tconfig = TransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=16, use_cpu_initialization=True
    )
    module = LEVEmbedding(lev_config, config=tconfig)
    table, build = timed(
        lambda: materialize_module_table(module, compute_dtype=torch.float32, progress=False),
        args.clock_fn,
    )
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        path = os.path.join(tmp, "embed.safetensors")

        def write():
            save_file({"model.embed_tokens.weight": table}, path)
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())

        _, written = timed(write, args.clock_fn)
        size = os.path.getsize(path)
    print(
        f"(b) LEV table V {V} x D {D} "
        f"(k={lev_config.num_digits}, b={lev_config.base}, h={lev_config.num_heads}, "
        f"r={lev_config.rank}, d_seed={lev_config.seed_dim}):\n"
        f"    materialise {build:6.1f} s ({V / build:,.0f} ids/s)\n"
        f"    write       {written:6.1f} s ({size / 2**30:.2f} GiB, "
        f"{size / 2**20 / written:,.0f} MiB/s)\n"
        f"    ratio materialise / write {build / written:.2f}   (target <= 1)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_defaults(p, new_tokens=256, prompt_tokens=32, batch=1, layers=4, hidden=256, heads=4)
    p.add_argument("--peer-batches", type=int, nargs="+", default=[1, 8])
    add_defaults(p, vocab=8192, pairs=3, table_vocab=200_064, table_hidden=2048)
    p.add_argument("--tmp-dir", default=None, help="where the table file is written")
    p.add_argument(
        "--step",
        choices=("auto", "lean", "megatron"),
        default="auto",
        help="(c)'s decode step (`generate(step=...)`); auto: what tools/generate.py picks",
    )
    p.add_argument("--skip-table", action="store_true")
    p.add_argument("--skip-kv-cache", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    add_timing_flags(
        p,
        "what (a) and (c) time: wall seconds, or this process's CPU seconds (steadier when "
        "other work shares the machine; rates are then tokens per CPU second)",
        "torch threads (default: torch's)",
    )
    args = p.parse_args()
    apply_timing_flags(p, args)

    from megatron_ext.inference.loading import init_inference_parallel

    pg = init_inference_parallel(1, 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}")
    if not args.skip_kv_cache:
        bench_kv_cache(args, pg)
    if not args.skip_transformers:
        bench_vs_transformers(args, pg)
    if not args.skip_table:
        bench_table(args)


if __name__ == "__main__":
    main()
