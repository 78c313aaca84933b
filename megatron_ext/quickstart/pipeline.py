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
from dataclasses import dataclass, field
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
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Training tokens per arm."""
        return self.iters * self.global_batch * self.seq_length


def _run(cmd: list[str], **kw) -> None:
    run_command(cmd, cwd=REPO, **kw)


# The commands the stages run: tools/ scripts and pretrain_leviathan.py from the source checkout
# (as the commands shown to the user), or the same modules of an installed package.
_MODULES = {
    "make_sample_corpus.py": "megatron_ext.data.make_sample_corpus",
    "train_tokenizer.py": "megatron_ext.data.train_tokenizer",
    "preprocess_data.py": "megatron_ext.data.preprocess_data",
    "evaluate.py": "megatron_ext.evaluation.evaluate",
    "convert_checkpoint.py": "megatron_ext.conversion.convert_checkpoint",
}


def _tool(s: Settings, script: str, *args: str) -> list[str]:
    path = REPO / "tools" / script
    return [s.python, *([str(path)] if path.is_file() else ["-m", _MODULES[script]]), *args]


def _entry(script: str) -> str:
    """A launch entry: the checkout's file, else the installed module."""
    path = REPO / script
    if path.is_file():
        return str(path)
    return (
        "pretrain_leviathan" if script == "pretrain_leviathan.py" else _MODULES[Path(script).name]
    )


def _launch(s: Settings, script: str, *args: str, log: Path, show: re.Pattern) -> None:
    run_launched(_entry(script), s.nproc, list(args), python=s.python, cwd=REPO, log=log,
                 show=show)  # fmt: skip


def _corpus(s: Settings, tmp: Path) -> str:
    if s.corpus:
        return f"using your corpus {s.corpus} (train) and {s.valid_corpus} (valid)"
    _run(_tool(s, "make_sample_corpus.py", "--output", str(tmp), "--size-mb", str(s.corpus_mb),
               "--seed", str(s.seed)))  # fmt: skip
    return f"sample corpus in {short_path(str(s.out / 'corpus'))} (train/, val.jsonl.zst)"


def _inputs(s: Settings) -> dict[str, str]:
    """split -> the corpus it is read from (yours, or the sample corpus)."""
    return {
        "train": s.corpus or str(s.out / "corpus" / "train"),
        "valid": s.valid_corpus or str(s.out / "corpus" / "val.jsonl.zst"),
    }


def _tokenizer(s: Settings, tmp: Path) -> str:
    _run(_tool(s, "train_tokenizer.py", "--input", _inputs(s)["train"], "--vocab-size",
               str(s.vocab_size), "--model-prefix", str(tmp / "sp"), "--seed", str(s.seed)),
         log=tmp / "train_tokenizer.log")  # fmt: skip
    return f"{s.vocab_size}-piece SentencePiece BPE model {short_path(str(_tok_model(s)))}"


def _tok_model(s: Settings) -> Path:
    return s.out / "tokenizer" / "sp.model"


def _data(s: Settings, tmp: Path) -> str:
    tok = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(_tok_model(s))]
    for split, src in _inputs(s).items():
        say(f"  preprocessing the {split} split")
        _run(_tool(s, "preprocess_data.py", "--input", src, "--output-prefix", str(tmp / split),
                   *tok, "--append-eod", "--workers", "2"),
             log=tmp / f"{split}.log", show=re.compile(r"done:|error"))  # fmt: skip
    train = short_path(str(s.out / "data" / "train"))
    return f"indexed datasets {train}_text_document / valid_text_document"


def build_stages(s: Settings) -> list[Stage]:
    """The pipeline for these settings (see the module docstring)."""
    train_prefix, valid_prefix = s.out / "data" / "train", s.out / "data" / "valid"
    tok_flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                 str(_tok_model(s))]  # fmt: skip
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
        train = _train_stage(s, arm, tok_flags, train_prefix, valid_prefix)
        # A training stage reads the data stages only: one arm runs without the others
        # (--stages train_ARM, one task of a job array).
        stages.append(Stage(f"train_{arm}", what, dict(model_key, arm=arm), train,
                            needs=("corpus", "tokenizer", "data")))  # fmt: skip
    eval_key = dict(model_key, arms=s.arms, bins=s.bin_edges)
    stages.append(Stage("evaluate", "evaluate: validation perplexity by token frequency",
                        eval_key, lambda tmp: _evaluate(s, tmp, valid_prefix)))  # fmt: skip
    stages.append(Stage("report", "report: tables, loss curves, frequency bars", eval_key,
                        lambda tmp: _report(s, tmp)))  # fmt: skip
    if s.export and "lev" in s.arms:
        what = "export LEVIATHAN to Hugging Face + greedy continuation"
        stages.append(Stage("export", what, dict(model_key, prompt=s.prompt),
                            lambda tmp: _export(s, tmp)))  # fmt: skip
    return stages


def _train_stage(s: Settings, arm: str, tok_flags, train_prefix: Path, valid_prefix: Path):
    def train(tmp: Path) -> str:
        args = (
            "pretrain_leviathan.py", "--tensor-model-parallel-size", str(s.nproc),
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
            "--train-data-path", f"{train_prefix}_text_document",
            "--valid-data-path", f"{valid_prefix}_text_document", *tok_flags,
            "--log-interval", str(max(1, min(10, s.iters // 4))),
            "--eval-interval", str(min(s.eval_interval, s.iters)),
            "--eval-iters", str(s.eval_iters), "--num-workers", "0",
            "--save", str(tmp / "ckpt"), "--save-interval", str(s.iters),
            "--tensorboard-dir", str(tmp / "tb"), "--log-jsonl", str(tmp / "train.jsonl"),
        )  # fmt: skip
        _launch(s, *args, log=tmp / "train.log", show=_SHOW)
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
        return (
            f"{info['parameters']:,} parameters, validation loss "
            f"{info['final_valid_loss']:.4f}; checkpoint in "
            f"{short_path(str(s.out / f'train_{arm}' / 'ckpt'))}"
        )

    return train


def _evaluate(s: Settings, tmp: Path, valid_prefix: Path) -> str:
    loads = []
    for arm in s.arms:
        loads += ["--load", str(s.out / f"train_{arm}" / "ckpt")]
    base = "tied" if "tied" in s.arms else s.arms[0]
    _launch(
        s,
        "tools/evaluate.py",
        "frequency",
        *loads,
        "--names",
        *s.arms,
        "--baseline",
        base,
        "--data-path",
        f"{valid_prefix}_text_document",
        "--tensor-model-parallel-size",
        str(s.nproc),
        "--micro-batch-size",
        "32",
        "--bin-edges",
        *[str(e) for e in s.bin_edges],
        "--output-dir",
        str(tmp / "frequency"),
        log=tmp / "evaluate.log",
        show=re.compile(r"tokens in .* s \(|^\||error"),
    )
    return f"frequency table {short_path(str(s.out / 'evaluate' / 'frequency' / 'frequency.md'))}"


def _report(s: Settings, tmp: Path) -> str:
    base = "tied" if "tied" in s.arms else s.arms[0]
    cmd = _tool(
        s,
        "evaluate.py",
        "curves",
        "--seq-length",
        str(s.seq_length),
        "--smoothing",
        "0.6",
        "--reference",
        base,
        "--output-dir",
        str(tmp),
    )
    for arm in s.arms:
        cmd += ["--run", f"{arm}={s.out / f'train_{arm}' / 'tb'}"]
    _run(cmd, log=tmp / "curves.log", show=re.compile(r"reach|error"))
    efficiency_lines = [
        ln.strip() for ln in (tmp / "curves.log").read_text().splitlines() if "reach" in ln
    ]
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
    _run(
        _tool(
            s,
            "convert_checkpoint.py",
            "export-hf",
            "--load",
            str(s.out / "train_lev" / "ckpt"),
            "--output",
            str(tmp / "hf"),
        )
    )
    say(f"  loading the export with transformers and continuing {s.prompt!r} greedily")
    # deferred: keeps torch (slow) out of this module's import
    import torch

    # optional: the [eval] extra
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    ids = tokenizer(s.prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    (tmp / "continuation.txt").write_text(text + "\n")
    say("  " + text.replace("\n", " "))
    return f"Hugging Face model {short_path(str(s.out / 'export' / 'hf'))}"


def build_parser() -> argparse.ArgumentParser:
    """The quick start's options (its model is tiny on purpose: minutes on a laptop CPU)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.add_argument(
        "--arms", nargs="+", default=["tied", "lev"], choices=ALL_ARMS, help="arms to train"
    )
    p.add_argument("--iters", type=int, default=150, help="training iterations per arm")
    p.add_argument("--nproc", type=int, default=2, help="CPU processes (= TP size)")
    p.add_argument("--corpus", help="your training jsonl file or directory (default: sample)")
    p.add_argument("--valid-corpus", help="your validation jsonl file (with --corpus)")
    p.add_argument("--corpus-mb", type=float, default=4.0, help="size of the sample corpus")
    p.add_argument(
        "--hidden-size", type=int, default=128, help="model width (a tiny model, for CPU minutes)"
    )
    p.add_argument("--num-layers", type=int, default=4, help="transformer layers (tiny, as above)")
    p.add_argument("--eval-interval", type=int, default=20, help="iterations between validations")
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export")
    p.add_argument("--title", default="Quick start: TIED vs LEVIATHAN", help="the report's title")
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


def parse_args(argv=None) -> tuple[Settings, bool]:
    """The command line -> (settings, --fresh); bad input exits 2 with one line."""
    s, fresh, _ = _parse(argv)
    return s, fresh


def _parse(argv=None) -> tuple[Settings, bool, Optional[list[str]]]:
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
    s = Settings(
        out=Path(a.out).resolve(),
        arms=tuple(dict.fromkeys(a.arms)),
        iters=a.iters,
        nproc=a.nproc,
        corpus=a.corpus and os.path.abspath(a.corpus),
        valid_corpus=a.valid_corpus and os.path.abspath(a.valid_corpus),
        corpus_mb=a.corpus_mb,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        eval_interval=a.eval_interval,
        export=not a.no_export,
        title=a.title,
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
    s, fresh, only = _parse(argv)
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
    report = s.out / "report" / "report.md"
    say(f"\nall stages done in {time.time() - start:.0f}s. Open:")
    say(f"  {short_path(str(report))}   (comparison table, loss curves, frequency bars)")
    say(
        f"  {short_path(str(s.out / 'report' / 'curves.png'))}, "
        f"{short_path(str(s.out / 'report' / 'frequency.png'))}"
    )
    if (s.out / "export" / "hf").is_dir():
        say(
            f"  {short_path(str(s.out / 'export' / 'hf'))}   "
            "(AutoModelForCausalLM.from_pretrained; "
            f"continuation in {short_path(str(s.out / 'export' / 'continuation.txt'))})"
        )
    return 0
