"""Generation and export speed, each measured against a baseline of this run.

  (a) `generate` with the KV cache / recomputing the whole prefix at every step (>> 1)
  (b) materialising the LEV table at V = --table-vocab, D = --table-hidden / writing that
      table as safetensors (target <= 1)
  (c) `generate` (as tools/generate.py) / transformers' `generate` on our HF export, at each
      of --peer-batches, --pairs interleaved runs: min and median ratio, and whether every
      pair gave the same tokens (target >= 1.2 at batch 1)

Compare the ratios, not the seconds. Run: `python benchmarks/bench_generate.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# The repository root, so that `benchmarks.hf_peer` imports when this file runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    add_timing_flags,
    apply_timing_flags,
    median_rate,
    ratio_line,
    timed,
)

_clock = time.perf_counter
"""--clock's function (`harness.CLOCKS`)."""


def _timed(fn):
    return timed(fn, _clock)


def _lev_model(args, pg):
    """(config, model) of the benchmarked LEV model, seeded, in eval mode."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import build_model

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.prompt_tokens + args.new_tokens,
        embedding=dict(embedding_type="lev"),
    )
    return config, build_model(
        config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg
    ).eval()


def bench_kv_cache(args, pg) -> None:
    from megatron_ext.inference.generation import SamplingConfig, generate

    _, model = _lev_model(args, pg)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens)).tolist()
    results = {}
    for use_cache in (True, False):
        cfg = SamplingConfig(max_new_tokens=args.new_tokens, use_cache=use_cache)
        warm_up = SamplingConfig(max_new_tokens=4, use_cache=use_cache)
        generate(model, prompts, warm_up, tp_group=pg.tp)
        out, seconds = _timed(lambda: generate(model, prompts, cfg, tp_group=pg.tp))
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

    config, model = _lev_model(args, pg)
    step = args.step if args.step != "auto" else decode_step_for(model)[0]
    hf = hf_export(model, config, tied=config.embedding.tied)
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
        ratios, same = [], True
        rates = {"ours": [], "theirs": []}
        for _ in range(args.pairs):
            a, t_ours = _timed(ours)
            b, t_theirs = _timed(theirs)
            same &= a == b
            rates["ours"].append(batch * n / t_ours)
            rates["theirs"].append(batch * n / t_theirs)
            ratios.append(t_theirs / t_ours)
        print(
            f"(c) greedy, {n} new tokens, prompt {args.prompt_tokens}, batch {batch}, "
            f"{args.layers} layers x D {args.hidden}, V {args.vocab}, {args.pairs} pairs:\n"
            f"    {'ours (' + step + ' step)':23s}{median_rate(rates['ours'], 8, 1)}\n"
            f"    transformers generate  {median_rate(rates['theirs'], 8, 1)}\n"
            + ratio_line(ratios, f"   (same tokens: {same})")
        )


def bench_table(args) -> None:
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.transformer import TransformerConfig
    from safetensors.torch import save_file

    from megatron_ext.conversion.source import materialize_module_table
    from megatron_ext.lev import LEVConfig, LEVEmbedding

    torch.manual_seed(0)
    lev_config = LEVConfig(vocab_size=args.table_vocab, hidden_size=args.table_hidden)
    tconfig = TransformerConfig(
        num_layers=1,
        hidden_size=args.table_hidden,
        num_attention_heads=16,
        use_cpu_initialization=True,
    )
    module = LEVEmbedding(lev_config, config=tconfig)
    table, build = _timed(
        lambda: materialize_module_table(module, compute_dtype=torch.float32, progress=False)
    )
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        path = os.path.join(tmp, "embed.safetensors")

        def write():
            save_file({"model.embed_tokens.weight": table}, path)
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())

        _, written = _timed(write)
        size = os.path.getsize(path)
    print(
        f"(b) LEV table V {args.table_vocab} x D {args.table_hidden} "
        f"(k={lev_config.num_digits}, b={lev_config.base}, h={lev_config.num_heads}, "
        f"r={lev_config.rank}, d_seed={lev_config.seed_dim}):\n"
        f"    materialise {build:6.1f} s ({args.table_vocab / build:,.0f} ids/s)\n"
        f"    write       {written:6.1f} s ({size / 2**30:.2f} GiB, "
        f"{size / 2**20 / written:,.0f} MiB/s)\n"
        f"    ratio materialise / write {build / written:.2f}   (target <= 1)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--peer-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--table-vocab", type=int, default=200_064)
    p.add_argument("--table-hidden", type=int, default=2048)
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
    global _clock
    _clock = apply_timing_flags(p, args)

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
