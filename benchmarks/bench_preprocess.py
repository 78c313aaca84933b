"""Preprocessing speed: our tools/preprocess_data.py against Megatron-LM's (tag core_v0.16.1,
run from its checkout by --megatron-python) on the KJV repeated to --size-mb, same SentencePiece
model and workers, in interleaved pairs of fresh processes: the seconds of each, the speed-up
(min, median), and whether every pair's .bin and .idx are byte-identical.

    python benchmarks/bench_preprocess.py --megatron-lm ../Megatron-LM --size-mb 25 --workers 2
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # `benchmarks.*` when this file runs as a script

from benchmarks.harness import add_defaults, rounds  # noqa: E402
from benchmarks.make_kjv_corpus import chapters  # noqa: E402


def write_corpus(path: str, size_mb: float) -> int:
    """KJV chapters repeated up to `size_mb` MB of jsonl; returns the number of documents."""
    docs = chapters()
    written = count = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size_mb * 1e6:
            doc = docs[count % len(docs)]
            copy = count // len(docs)
            line = json.dumps({"text": doc["text"], "id": f"{doc['id']} #{copy}"}) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            count += 1
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
    add_defaults(parser, size_mb=25.0, workers=2, vocab_size=8000, pairs=3)
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

    def tool(cmd: list[str], env: dict, out: str):
        os.makedirs(out, exist_ok=True)
        return lambda pair: _run([*cmd, "--output-prefix", os.path.join(out, str(pair))], env)

    ours, mlm = os.path.join(work, "ours"), os.path.join(work, "mlm")
    times = rounds(
        {"theirs": tool(theirs_cmd, theirs_env, mlm), "ours": tool(ours_cmd, ours_env, ours)},
        args.pairs,
    )
    names = [f"{pair}_text_document{ext}" for pair in range(args.pairs) for ext in (".bin", ".idx")]
    identical = filecmp.cmpfiles(ours, mlm, names, shallow=False)[0] == names
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
