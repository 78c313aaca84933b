#!/usr/bin/env python
"""The two Hugging Face exports of a LEV checkpoint at the paper's 1.2B shape: bytes and time.

Builds `--model-size 1.2b --embedding-type lev` with the o200k vocabulary at TP=1 and
`--num-layers` of its 16 layers, saves it as a training checkpoint, then runs `export-hf
--hf-format llama` (LEV materialised) and `--hf-format leviathan` (LEV kept), each with
--dtype bfloat16 --no-tokenizer, and prints each export's wall time and bytes, the bytes
extrapolated to 16 layers and the ratio llama / leviathan. Needs `pip install -e .[scale,eval]`:

    python benchmarks/bench_hf_export.py --num-layers 2 --out /tmp/bench_hf_export
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

FULL_LAYERS = 16


def build_checkpoint(out: Path, tokenizer: Path, num_layers: int) -> Path:
    """A freshly initialised 1.2B-shape LEV checkpoint (TP=1, no optimizer) in `out/ckpt`."""
    from megatron_ext.checkpoint.format import TrainState, save_checkpoint
    from megatron_ext.config.arguments import args_json_of_flags, model_config_from_args_json
    from megatron_ext.config.data import padded_vocab_size
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.inference.loading import init_inference_parallel
    from megatron_ext.models import build_model
    from megatron_ext.parallel import destroy_parallel

    tok = build_tokenizer("TikTokenizer", str(tokenizer), tiktoken_pattern="o200k")
    flags = [
        "--model-size", "1.2b", "--num-layers", str(num_layers), "--embedding-type", "lev",
        "--seq-length", "512", "--tokenizer-type", "TikTokenizer",
        "--tokenizer-model", str(tokenizer), "--tiktoken-pattern", "o200k",
    ]  # fmt: skip
    args_json = {**args_json_of_flags(flags), "tokenizer_fingerprint": tok.fingerprint}
    padded = padded_vocab_size(tok.vocab_size, args_json["make_vocab_size_divisible_by"])
    config = model_config_from_args_json(args_json).replace(vocab_size=padded)
    pg = init_inference_parallel(1, 1)
    model = build_model(config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    ckpt = out / "ckpt"
    save_checkpoint(str(ckpt), TrainState(), model, pg=pg, args_json=args_json, save_rng=False)
    destroy_parallel()
    print(
        f"checkpoint: V = {tok.vocab_size:,} (padded {padded:,}), D = {config.hidden_size}, "
        f"{num_layers} of {FULL_LAYERS} layers, LEV {config.embedding.lev.num_parameters():,} "
        "parameters",
        flush=True,
    )
    return ckpt


def export(ckpt: Path, output: Path, fmt: str) -> float:
    """Wall seconds of `tools/convert_checkpoint.py export-hf --hf-format fmt`."""
    shutil.rmtree(output, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "export-hf",
           "--load", str(ckpt), "--output", str(output), "--hf-format", fmt,
           "--dtype", "bfloat16", "--no-tokenizer", "--no-progress"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def layer_bytes(output: Path) -> int:
    """Bytes of decoder layer 0's tensors in the export's safetensors (bf16)."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(output):
        if name.endswith(".safetensors"):
            with safe_open(str(output / name), framework="pt") as handle:
                for key in handle.keys():
                    if key.startswith("model.layers.0."):
                        t = handle.get_slice(key)
                        n = 1
                        for s in t.get_shape():
                            n *= s
                        total += n * 2
    return total


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=2, help="decoder layers built (of 16)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_hf_export"))
    args = parser.parse_args()
    from scale_1p2b import o200k_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = o200k_tokenizer(args.out)
    ckpt = build_checkpoint(args.out, tokenizer, args.num_layers)
    rows = {}
    for fmt in ("llama", "leviathan"):
        output = args.out / f"hf_{fmt}"
        seconds = export(ckpt, output, fmt)
        size = dir_bytes(output)
        full = size + (FULL_LAYERS - args.num_layers) * layer_bytes(output)
        rows[fmt] = (seconds, size, full)
        print(
            f"{fmt:>9}: {seconds:6.1f} s, {size / 1e9:.3f} GB at {args.num_layers} layers, "
            f"{full / 1e9:.3f} GB at {FULL_LAYERS} layers",
            flush=True,
        )
    (ls, lb, lf), (ks, kb, kf) = rows["llama"], rows["leviathan"]
    print(
        f"llama / leviathan: bytes {lb / kb:.2f}x at {args.num_layers} layers, {lf / kf:.2f}x at "
        f"{FULL_LAYERS} layers (saved: {(lf - kf) / 1e9:.3f} GB); time {ls / ks:.2f}x"
    )
    print(
        json.dumps(
            {k: dict(zip(("seconds", "bytes", "bytes_16_layers"), v)) for k, v in rows.items()}
        )
    )


if __name__ == "__main__":
    main()
