#!/usr/bin/env python
"""Preprocessing throughput: ours vs. a baseline built the way Megatron-LM's
tools/preprocess_data.py works, on the same generated corpus, same tokenizer, same workers.

Baseline: the decompressed .jsonl (Megatron cannot read .zst) is fed line by line through
``multiprocessing.Pool.imap(encoder.encode, lines, 25)``; each task parses one JSON document and
tokenizes it; the main process writes with Megatron-Core's IndexedDatasetBuilder. Ours reads the
.jsonl.zst directly and also writes token counts. If MEGATRON_LM_DIR points at a Megatron-LM
checkout, its real tools/preprocess_data.py is timed too (GPTSentencePieceTokenizer).

    python benchmarks/bench_preprocess.py --size-mb 40 --workers 2 --vocab-size 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

from megatron_ext.data.indexed import num_tokens, token_dtype
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import iter_blocks
from megatron_ext.data.sample_corpus import write_sample_corpus
from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_ext.data.tokenizers import build_tokenizer


class _MegatronStyleEncoder:
    """One document per task, as Megatron-LM's Encoder.encode (without sentence splitting)."""

    def __init__(self, model: str, append_eod: bool) -> None:
        self.model = model
        self.append_eod = append_eod

    def initializer(self) -> None:
        _MegatronStyleEncoder.tokenizer = build_tokenizer("SentencePieceTokenizer", self.model)

    def encode(self, line: str):
        data = json.loads(line)
        ids = _MegatronStyleEncoder.tokenizer.tokenize(data["text"])
        if self.append_eod and ids:
            ids.append(_MegatronStyleEncoder.tokenizer.eod)
        return ids, len(line)


def run_baseline(jsonl: str, model: str, prefix: str, workers: int) -> float:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = build_tokenizer("SentencePieceTokenizer", model)
    encoder = _MegatronStyleEncoder(model, append_eod=True)
    start = time.perf_counter()
    with open(jsonl, encoding="utf-8") as fin:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype(tok.vocab_size))
        for ids, _ in pool.imap(encoder.encode, fin, 25):
            if ids:
                builder.add_document(torch.tensor(ids), [len(ids)])
        builder.finalize(prefix + ".idx")
        pool.close()
        pool.join()
    return time.perf_counter() - start


def run_ours(zst: str, model: str, prefix: str, workers: int) -> float:
    start = time.perf_counter()
    preprocess(
        PreprocessConfig(
            input=[zst],
            output_prefix=prefix,
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=model,
            append_eod=True,
            workers=workers,
            log_interval=10**9,
        )
    )
    return time.perf_counter() - start


def run_megatron_lm(checkout: str, jsonl: str, model: str, prefix: str, workers: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            os.path.join(checkout, "tools", "preprocess_data.py"),
            "--input",
            jsonl,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "GPTSentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "1000000",
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": checkout},
    )
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description="preprocess throughput vs Megatron-style")
    parser.add_argument("--size-mb", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs each")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_")
    paths = write_sample_corpus(os.path.join(work, "corpus"), size_mb=args.size_mb, seed=1)
    zst = paths["train/00"]
    jsonl = os.path.join(work, "train.jsonl")
    with open(jsonl, "wb") as out:
        for block in iter_blocks(zst):
            out.write(block)
    model = train_sentencepiece(
        TokenizerTrainingConfig(
            input=[paths["val"]],
            model_prefix=os.path.join(work, "tok"),
            vocab_size=args.vocab_size,
            num_threads=args.workers,
            overwrite=True,
        )
    )
    results = {}
    for name, fn in (
        ("megatron-style", lambda p: run_baseline(jsonl, model, p, args.workers)),
        ("ours", lambda p: run_ours(zst, model, p, args.workers)),
    ):
        times = []
        for r in range(args.repeats):
            prefix = os.path.join(work, f"{name}_{r}")
            out_prefix = prefix if name == "megatron-style" else prefix
            times.append(fn(out_prefix))
            dataset = prefix if name == "megatron-style" else prefix + "_text_document"
            results[name] = (min(times), num_tokens(dataset))
            for f in os.listdir(work):
                if f.startswith(f"{name}_{r}"):
                    os.remove(os.path.join(work, f))
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:
        prefix = os.path.join(work, "mlm")
        results["Megatron-LM tool"] = (
            run_megatron_lm(checkout, jsonl, model, prefix, args.workers),
            num_tokens(prefix + "_text_document"),
        )
    size = os.path.getsize(jsonl) / 1e6
    print(
        f"corpus {size:.1f} MB jsonl, vocab {args.vocab_size}, workers {args.workers}, "
        f"cpus {os.cpu_count()}"
    )
    base_rate = results["megatron-style"][1] / results["megatron-style"][0]
    for name, (seconds, tokens) in results.items():
        rate = tokens / seconds
        print(
            f"{name:>18}: {seconds:7.2f} s  {tokens:>11,d} tokens  {rate:>12,.0f} tokens/s  "
            f"{size / seconds:6.2f} MB/s  x{rate / base_rate:.2f}"
        )
    ratio = (results["ours"][1] / results["ours"][0]) / base_rate
    print(f"speed-up ours / megatron-style: {ratio:.2f}x (target >= 1.5x)")
    assert results["ours"][1] == results["megatron-style"][1], "token totals differ"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
