"""The quick start's pipeline: corpus -> tokenizer -> datasets -> training of several arms ->
evaluation -> report (tables + PNGs) -> Hugging Face export and a greedy continuation through
transformers, each a resumable stage (:mod:`megatron_ext.quickstart.stages`).

Used by ``scripts/quickstart.sh`` (TIED vs LEVIATHAN in under ten minutes) and by
``examples/reproduce_small.sh`` (all six arms, about an hour) through ``tools/quickstart.py``.
The stages run the project's own tools and ``pretrain_leviathan.py`` from the source checkout,
exactly as a user would type them (each command is echoed). ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_ext import cpu_accel
from megatron_ext.cli import run_tool
from megatron_ext.config.flags import ArgumentParser
from megatron_ext.evaluation.report import write_comparison_report
from megatron_ext.quickstart.stages import (
    Stage,
    StageError,
    run_command,
    run_launched,
    run_stages,
    say,
    short_path,
)

__all__ = ["ALL_ARMS", "REPO", "Settings", "build_stages", "main", "parse_args"]

# The source checkout whose tools/ and pretrain_leviathan.py the stages run.
REPO = Path(__file__).resolve().parents[2]
ALL_ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
# Training output worth showing live; the full log is kept in the stage's train.log.
_SHOW = re.compile(r"iteration\s+\d+/|validation loss|model parameters|error|Error|Traceback")


@dataclass
class Settings:
    """Everything that decides the outputs; a stage is redone when its part changes."""

    out: Path
    arms: tuple[str, ...] = ("tied", "lev")
    iters: int = 150
    nproc: int = 2
    corpus: Optional[str] = None
    valid_corpus: Optional[str] = None
    corpus_mb: float = 4.0
    vocab_size: int = 4096
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    seq_length: int = 128
    micro_batch: int = 8
    global_batch: int = 16
    lr: float = 2e-3
    eval_interval: int = 20
    eval_iters: int = 4
    seed: int = 1234
    bin_edges: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2)
    export: bool = True
    prompt: str = "The history of the river"
    title: str = "Quick start: TIED vs LEVIATHAN"
    python: str = sys.executable

    @property
    def tokens(self) -> int:
        """Training tokens per arm."""
        return self.iters * self.global_batch * self.seq_length

    @property
    def baseline(self) -> str:
        """The arm the others are compared with: TIED if trained, else the first."""
        return "tied" if "tied" in self.arms else self.arms[0]


# The commands the stages run: tools/ scripts and pretrain_leviathan.py from the source checkout
# (as the commands shown to the user), or the same modules of an installed package.
_MODULES = {
    "pretrain_leviathan.py": "pretrain_leviathan",
    "make_sample_corpus.py": "megatron_ext.data.make_sample_corpus",
    "train_tokenizer.py": "megatron_ext.data.train_tokenizer",
    "preprocess_data.py": "megatron_ext.data.preprocess_data",
    "evaluate.py": "megatron_ext.evaluation.evaluate",
    "convert_checkpoint.py": "megatron_ext.conversion.convert_checkpoint",
}


def _entry(script: str) -> str:
    """The checkout's `script` (`tools/x.py` or `pretrain_leviathan.py`), else its module."""
    path = REPO / script
    return str(path) if path.is_file() else _MODULES[path.name]


def _tool(s: Settings, script: str, *args: str, **kw) -> None:
    """Run `tools/<script>` with `args` (`run_command`'s `kw`)."""
    entry = _entry(f"tools/{script}")
    cmd = [s.python, *([entry] if entry.endswith(".py") else ["-m", entry]), *args]
    run_command(cmd, cwd=REPO, **kw)


def _launch(s: Settings, script: str, *args: str, log: Path, show: re.Pattern) -> None:
    run_launched(_entry(script), s.nproc, list(args), python=s.python, cwd=REPO, log=log,
                 show=show)  # fmt: skip


def _corpus(s: Settings, tmp: Path) -> str:
    if s.corpus:
        return f"using your corpus {s.corpus} (train) and {s.valid_corpus} (valid)"
    _tool(s, "make_sample_corpus.py", "--output", str(tmp), "--size-mb", str(s.corpus_mb),
          "--seed", str(s.seed))  # fmt: skip
    return f"sample corpus in {short_path(str(s.out / 'corpus'))} (train/, val.jsonl.zst)"


def _inputs(s: Settings) -> dict[str, str]:
    """split -> the corpus it is read from (yours, or the sample corpus)."""
    return {
        "train": s.corpus or str(s.out / "corpus" / "train"),
        "valid": s.valid_corpus or str(s.out / "corpus" / "val.jsonl.zst"),
    }


def _tokenizer(s: Settings, tmp: Path) -> str:
    _tool(s, "train_tokenizer.py", "--input", _inputs(s)["train"], "--vocab-size",
          str(s.vocab_size), "--model-prefix", str(tmp / "sp"), "--seed", str(s.seed),
          log=tmp / "train_tokenizer.log")  # fmt: skip
    return f"{s.vocab_size}-piece SentencePiece BPE model {short_path(str(_tok_model(s)))}"


def _tok_model(s: Settings) -> Path:
    return s.out / "tokenizer" / "sp.model"


def _tok_flags(s: Settings) -> list[str]:
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(_tok_model(s))]


def _dataset(s: Settings, split: str) -> str:
    """The prefix of the `split` indexed dataset."""
    return f"{s.out / 'data' / split}_text_document"


def _data(s: Settings, tmp: Path) -> str:
    for split, src in _inputs(s).items():
        say(f"  preprocessing the {split} split")
        _tool(s, "preprocess_data.py", "--input", src, "--output-prefix", str(tmp / split),
              *_tok_flags(s), "--append-eod", "--workers", "2",
              log=tmp / f"{split}.log", show=re.compile(r"done:|error"))  # fmt: skip
    train = short_path(str(s.out / "data" / "train"))
    return f"indexed datasets {train}_text_document / valid_text_document"


def build_stages(s: Settings) -> list[Stage]:
    """The pipeline for these settings (see the module docstring)."""
    corpus_key = dict(corpus=s.corpus, valid=s.valid_corpus, mb=s.corpus_mb, seed=s.seed)
    stages = [
        Stage("corpus", "corpus", corpus_key, functools.partial(_corpus, s)),
        Stage("tokenizer", "tokenizer", dict(corpus_key, vocab=s.vocab_size),
              functools.partial(_tokenizer, s)),
        Stage("data", "preprocess train/valid", dict(corpus_key, vocab=s.vocab_size),
              functools.partial(_data, s)),
    ]  # fmt: skip
    model_key = dict(
        corpus_key, vocab=s.vocab_size, iters=s.iters, nproc=s.nproc, layers=s.num_layers,
        hidden=s.hidden_size, heads=s.num_heads, seq=s.seq_length, mbs=s.micro_batch,
        gbs=s.global_batch, lr=s.lr, eval=(s.eval_interval, s.eval_iters),
    )  # fmt: skip
    for arm in s.arms:
        what = (f"train {arm.upper()} ({s.iters} iterations, {s.tokens:,} tokens, "
                f"{s.nproc} CPU processes, TP={s.nproc})")  # fmt: skip
        # A training stage reads the data stages only: one arm runs without the others
        # (--stages train_ARM, one task of a job array).
        stages.append(Stage(f"train_{arm}", what, dict(model_key, arm=arm),
                            functools.partial(_train, s, arm),
                            needs=("corpus", "tokenizer", "data")))  # fmt: skip
    eval_key = dict(model_key, arms=s.arms, bins=s.bin_edges)
    stages.append(Stage("evaluate", "evaluate: validation perplexity by token frequency",
                        eval_key, functools.partial(_evaluate, s)))  # fmt: skip
    stages.append(Stage("report", "report: tables, loss curves, frequency bars", eval_key,
                        functools.partial(_report, s)))  # fmt: skip
    if s.export and "lev" in s.arms:
        what = "export LEVIATHAN to Hugging Face + greedy continuation"
        stages.append(Stage("export", what, dict(model_key, prompt=s.prompt),
                            functools.partial(_export, s)))  # fmt: skip
    return stages


def _train(s: Settings, arm: str, tmp: Path) -> str:
    _launch(
        s, "pretrain_leviathan.py", "--tensor-model-parallel-size", str(s.nproc),
        "--sequence-parallel", "--embedding-type", arm,
        # LEV's sizes for a D=128 model; its training controls are the project defaults.
        "--lev-num-heads", "4", "--lev-seed-dim", "64", "--lev-rank", "16",
        "--num-layers", str(s.num_layers), "--hidden-size", str(s.hidden_size),
        "--num-attention-heads", str(s.num_heads), "--seq-length", str(s.seq_length),
        "--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(s.global_batch),
        "--train-iters", str(s.iters), "--lr", str(s.lr), "--min-lr", str(s.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, s.iters // 10)),
        "--weight-decay", "0.1", "--clip-grad", "1.0",
        # The study's choice: no dropout (Megatron-LM's default is 0.1).
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", str(s.seed),
        "--train-data-path", _dataset(s, "train"), "--valid-data-path", _dataset(s, "valid"),
        *_tok_flags(s), "--log-interval", str(max(1, min(10, s.iters // 4))),
        "--eval-interval", str(min(s.eval_interval, s.iters)),
        "--eval-iters", str(s.eval_iters), "--num-workers", "0",
        "--save", str(tmp / "ckpt"), "--save-interval", str(s.iters),
        "--tensorboard-dir", str(tmp / "tb"), "--log-jsonl", str(tmp / "train.jsonl"),
        log=tmp / "train.log", show=_SHOW,
    )  # fmt: skip
    text = (tmp / "train.log").read_text()
    params = re.findall(r"model parameters: (\d+)", text)
    vals = re.findall(r"validation loss at iteration\s+(\d+) \| lm loss value: (\S+)", text)
    if not params or not vals:
        raise StageError(
            f"training log {tmp / 'train.log'} has no parameter count or validation loss"
        )
    info = dict(
        arm=arm,
        parameters=int(params[-1]),
        final_iteration=int(vals[-1][0]),
        final_valid_loss=float(vals[-1][1]),
        tokens=s.tokens,
    )
    (tmp / "run.json").write_text(json.dumps(info, indent=1))
    ckpt, loss = short_path(str(s.out / f"train_{arm}" / "ckpt")), info["final_valid_loss"]
    return f"{info['parameters']:,} parameters, validation loss {loss:.4f}; checkpoint in {ckpt}"


def _evaluate(s: Settings, tmp: Path) -> str:
    loads = [flag for arm in s.arms for flag in ("--load", str(s.out / f"train_{arm}" / "ckpt"))]
    _launch(
        s, "tools/evaluate.py", "frequency", *loads, "--names", *s.arms, "--baseline", s.baseline,
        "--data-path", _dataset(s, "valid"), "--tensor-model-parallel-size", str(s.nproc),
        "--micro-batch-size", "32", "--bin-edges", *[str(e) for e in s.bin_edges],
        "--output-dir", str(tmp / "frequency"),
        log=tmp / "evaluate.log", show=re.compile(r"tokens in .* s \(|^\||error"),
    )  # fmt: skip
    return f"frequency table {short_path(str(s.out / 'evaluate' / 'frequency' / 'frequency.md'))}"


def _report(s: Settings, tmp: Path) -> str:
    run_flags = [a for arm in s.arms for a in ("--run", f"{arm}={s.out / f'train_{arm}' / 'tb'}")]
    _tool(s, "evaluate.py", "curves", "--seq-length", str(s.seq_length), "--smoothing", "0.6",
          "--reference", s.baseline, "--output-dir", str(tmp), *run_flags,
          log=tmp / "curves.log", show=re.compile(r"reach|error"))  # fmt: skip
    logged = (tmp / "curves.log").read_text().splitlines()
    efficiency_lines = [line.strip() for line in logged if "reach" in line]
    freq_dir = s.out / "evaluate" / "frequency"
    shutil.copy(freq_dir / "frequency.png", tmp / "frequency.png")
    setup = (
        f"Same backbone ({s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads, "
        f"sequence {s.seq_length}), seed {s.seed}, data order and token budget for every arm: "
        f"{s.iters} iterations x {s.global_batch} sequences = {s.tokens:,} tokens, "
        f"{s.nproc} CPU processes at TP={s.nproc}. Vocabulary: {s.vocab_size} SentencePiece "
        "pieces. Only `--embedding-type` differs."
    )
    write_comparison_report(
        tmp,
        title=s.title,
        setup=setup,
        arms=s.arms,
        runs={a: json.loads((s.out / f"train_{a}" / "run.json").read_text()) for a in s.arms},
        freq=json.loads((freq_dir / "frequency.json").read_text()),
        freq_md=(freq_dir / "frequency.md").read_text(),
        efficiency_lines=efficiency_lines,
        bin_edges=s.bin_edges,
    )
    return f"{short_path(str(s.out / 'report' / 'report.md'))} with curves.png and frequency.png"


def _export(s: Settings, tmp: Path) -> str:
    _tool(s, "convert_checkpoint.py", "export-hf", "--load", str(s.out / "train_lev" / "ckpt"),
          "--output", str(tmp / "hf"))  # fmt: skip
    say(f"  loading the export with transformers and continuing {s.prompt!r} greedily")
    # optional: the [eval] extra
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype="float32")
    ids = tokenizer(s.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)  # without autograd
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    (tmp / "continuation.txt").write_text(text + "\n")
    say("  " + text.replace("\n", " "))
    return f"Hugging Face model {short_path(str(s.out / 'export' / 'hf'))}"


def build_parser() -> argparse.ArgumentParser:
    """The quick start's options (its model is tiny on purpose: minutes on a laptop CPU)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    d = Settings
    p.add_argument(
        "--arms", nargs="+", default=list(d.arms), choices=ALL_ARMS, help="arms to train"
    )
    p.add_argument("--iters", type=int, default=d.iters, help="training iterations per arm")
    p.add_argument("--nproc", type=int, default=d.nproc, help="CPU processes (= TP size)")
    p.add_argument("--corpus", help="your training jsonl file or directory (default: sample)")
    p.add_argument("--valid-corpus", help="your validation jsonl file (with --corpus)")
    p.add_argument("--corpus-mb", type=float, default=d.corpus_mb, help="size of the sample corpus")
    p.add_argument(
        "--hidden-size", type=int, default=d.hidden_size, help="model width (tiny: CPU minutes)"
    )
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="layers (tiny too)")
    p.add_argument(
        "--eval-interval", type=int, default=d.eval_interval, help="iterations between validations"
    )
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export")
    p.add_argument("--title", default=d.title, help="the report's title")
    p.add_argument("--fresh", action="store_true", help="delete OUT and start over")
    p.add_argument(
        "--stages",
        nargs="+",
        metavar="STAGE",
        help="run only these stages (corpus tokenizer data train_ARM... evaluate report export); "
        "the earlier ones must be finished: how a cluster job array splits the study "
        "(examples/slurm/study.sh)",
    )
    p.add_argument(
        "--no-cpu-accel",
        action="store_true",
        help="run every stage without the CPU accelerations (compiled C++ kernels, host-memory "
        "tuning): the portable paths, same results, slower; as MEGATRON_EXT_CPU_ACCEL=0",
    )
    return p


def parse_args(argv=None) -> tuple[Settings, bool, Optional[list[str]]]:
    """(settings, --fresh, --stages) of the command line; bad input exits 2 with one line."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.no_cpu_accel:
        cpu_accel.disable()  # the stages' processes inherit it
    if a.iters < 1:
        p.error("--iters must be at least 1")
    if bool(a.corpus) != bool(a.valid_corpus):
        p.error("--corpus and --valid-corpus go together (a training and a validation jsonl)")
    for path in (a.corpus, a.valid_corpus):
        if path and not os.path.exists(path):
            p.error(f"{path} does not exist")
    same = ("iters", "nproc", "corpus_mb", "hidden_size", "num_layers", "eval_interval", "title")
    s = Settings(
        out=Path(a.out).resolve(),
        arms=tuple(dict.fromkeys(a.arms)),
        corpus=a.corpus and os.path.abspath(a.corpus),
        valid_corpus=a.valid_corpus and os.path.abspath(a.valid_corpus),
        export=not a.no_export,
        **{name: getattr(a, name) for name in same},
    )
    if a.stages:
        names = [stage.name for stage in build_stages(s)]
        unknown = [name for name in a.stages if name not in names]
        if unknown:
            p.error(f"--stages {' '.join(unknown)}: no such stage here (stages: {' '.join(names)})")
        if a.fresh:
            p.error("--fresh deletes every stage: not with --stages")
    return s, a.fresh, a.stages


def main(argv=None) -> int:
    """Run (or resume) the quick start; 0 when every stage is done, 1 when one failed."""
    return run_tool(_main, argv, log_format=None)


def _main(argv) -> int:
    s, fresh, only = parse_args(argv)
    if fresh and s.out.exists():
        say(f"--fresh: removing {short_path(str(s.out))}")
        shutil.rmtree(s.out)
    # Ctrl-C and SIGTERM discard the running stage, also when started where SIGINT is ignored
    # (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    start = time.time()
    try:
        run_stages(build_stages(s), s.out, only)
    except StageError as e:
        say(f"\nerror: {e}")
        say("rerun the same command to retry from the failed stage")
        return 1
    if only:
        say(f"\nstages {' '.join(only)} done in {time.time() - start:.0f}s")
        return 0

    def shown(*parts: str) -> str:
        return short_path(str(s.out.joinpath(*parts)))

    say(f"\nall stages done in {time.time() - start:.0f}s. Open:")
    say(f"  {shown('report', 'report.md')}   (comparison table, loss curves, frequency bars)")
    say(f"  {shown('report', 'curves.png')}, {shown('report', 'frequency.png')}")
    if (s.out / "export" / "hf").is_dir():
        say(
            f"  {shown('export', 'hf')}   (AutoModelForCausalLM.from_pretrained; continuation "
            f"in {shown('export', 'continuation.txt')})"
        )
    return 0
