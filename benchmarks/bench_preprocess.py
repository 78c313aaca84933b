#!/usr/bin/env python
"""Preprocessing speed: our tools/preprocess_data.py against Megatron-LM's (tag core_v0.16.1,
run from its checkout), same corpus, SentencePiece model and workers, in one run.

The corpus is the King James Bible repeated to --size-mb; each tool is a fresh process, run in
interleaved pairs. Prints the seconds of each, the speed-up (theirs / ours) as min and median,
and whether every pair's .bin and .idx are byte-identical (--megatron-python: another
interpreter for Megatron-LM's script).

    python benchmarks/bench_preprocess.py --megatron-lm ../Megatron-LM --size-mb 25 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, size_mb: float) -> int:
    """KJV chapters repeated up to `size_mb` MB of jsonl; returns the number of documents."""
    from make_kjv_corpus import chapters  # beside this script (its directory is on sys.path)

    docs = chapters()
    written = count = 0
    with open(path, "w", encoding="utf-8") as out:
        copy = 0
        while written < size_mb * 1e6:
            for doc in docs:
                line = json.dumps({"text": doc["text"], "id": f"{doc['id']} #{copy}"}) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                count += 1
                if written >= size_mb * 1e6:
                    break
            copy += 1
    return count


def _run(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:2])} failed:\n{result.stderr[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--megatron-lm",
        default=os.environ.get("MEGATRON_LM_DIR"),
        help="Megatron-LM checkout at core_v0.16.1 (or MEGATRON_LM_DIR)",
    )
    parser.add_argument("--megatron-python", default=sys.executable)
    parser.add_argument("--size-mb", type=float, default=25.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    script = os.path.join(args.megatron_lm or "", "tools", "preprocess_data.py")
    if not args.megatron_lm or not os.path.isfile(script):
        print("error: pass --megatron-lm DIR, a Megatron-LM checkout at tag core_v0.16.1 "
              "(holding tools/preprocess_data.py)", file=sys.stderr)  # fmt: skip
        return 2
    from megatron_ext.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece

    work = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_")
    jsonl = os.path.join(work, "kjv.jsonl")
    documents = write_corpus(jsonl, args.size_mb)
    model = train_sentencepiece(
        TokenizerTrainingConfig(
            input=[jsonl], model_prefix=os.path.join(work, "tok"), vocab_size=args.vocab_size,
            input_sentence_size=200_000, num_threads=args.workers, overwrite=True,
        )
    )  # fmt: skip
    common = ["--input", jsonl, "--tokenizer-model", model, "--append-eod",
              "--workers", str(args.workers)]  # fmt: skip
    theirs_cmd = [args.megatron_python, script, *common, "--tokenizer-type",
                  "GPTSentencePieceTokenizer", "--log-interval", "100000000"]  # fmt: skip
    ours_cmd = [
        sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *common,
        "--tokenizer-type", "SentencePieceTokenizer", "--log-interval", "100000000",
    ]  # fmt: skip
    theirs_env = {**os.environ, "PYTHONPATH": os.path.abspath(args.megatron_lm)}
    ours_env = {**os.environ, "PYTHONPATH": REPO}
    times: dict[str, list[float]] = {"theirs": [], "ours": []}
    identical = True
    for pair in range(args.pairs):
        mine, peer = os.path.join(work, f"ours{pair}"), os.path.join(work, f"mlm{pair}")
        times["theirs"].append(_run([*theirs_cmd, "--output-prefix", peer], theirs_env))
        times["ours"].append(_run([*ours_cmd, "--output-prefix", mine], ours_env))
        for ext in (".bin", ".idx"):
            with (
                open(f"{mine}_text_document{ext}", "rb") as a,
                open(f"{peer}_text_document{ext}", "rb") as b,
            ):
                identical &= a.read() == b.read()
        for name in os.listdir(work):
            if name.startswith((f"ours{pair}", f"mlm{pair}")):
                os.remove(os.path.join(work, name))
    ratios = [t / o for t, o in zip(times["theirs"], times["ours"])]
    size = os.path.getsize(jsonl) / 1e6
    print(f"corpus {size:.1f} MB jsonl (KJV, {documents} documents), SentencePiece "
          f"{args.vocab_size}, workers {args.workers}, cpus {os.cpu_count()}, "
          f"{args.pairs} interleaved pairs")  # fmt: skip
    for name, label in (("theirs", "Megatron-LM core_v0.16.1"), ("ours", "ours")):
        values = times[name]
        print(f"  {label:>25}: median {statistics.median(values):6.2f} s "
              f"(min {min(values):.2f}, max {max(values):.2f})")  # fmt: skip
    print(f"  speed-up ours vs Megatron-LM: min {min(ratios):.2f}x median "
          f"{statistics.median(ratios):.2f}x (target >= 1.5x); .bin/.idx byte-identical: "
          f"{identical}")  # fmt: skip
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
