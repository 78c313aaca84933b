"""The whole product on CPU, stage by stage: corpus -> tokenizer -> datasets -> training of
several arms -> evaluation -> report (tables + PNGs) -> Hugging Face export and a greedy
continuation through transformers.

Used by ``scripts/quickstart.sh`` (TIED vs LEVIATHAN in under ten minutes) and by
``examples/reproduce_small.sh`` (all six arms, about an hour). Every stage writes into a hidden
temporary directory ``OUT/.<stage>.tmp``, puts a completion marker there, and renames it to
``OUT/<stage>`` only when its outputs are complete, so an interrupted or failed stage leaves
nothing behind and is redone by the next run; a finished stage whose settings did not change
is reused. ``--fresh`` starts over.

    python tools/quickstart.py --out runs/quickstart                # TIED vs LEV, 5-8 minutes
    python tools/quickstart.py --out runs/qs_short --iters 20       # a shortened run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = ".complete.json"
ALL_ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
# Training output worth showing live; the full log is kept in the stage's train.log.
_SHOW = re.compile(r"iteration\s+\d+/|validation loss|model parameters|error|Error|Traceback")
# The paper's decomposition of LEV's gain, as a chain of arms that each add one ingredient:
# linear compression (ALBERT) -> continuous generation from a plain seed (FLAT-MLP) ->
# compositional digit seed (FACTORED-MLP) -> separable spline instead of an MLP (LEV).
DECOMPOSITION = (
    ("continuous representation", "albert", "flat-mlp"),
    ("compositional structure", "flat-mlp", "factored-mlp"),
    ("separable spline smoothness", "factored-mlp", "lev"),
)


class QuickstartError(RuntimeError):
    """A stage failed; the message says which and where its log is."""


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
        return self.iters * self.global_batch * self.seq_length


def say(msg: str = "") -> None:
    print(msg, flush=True)


def run_command(cmd: list[str], log: Optional[Path] = None, show: Optional[re.Pattern] = None):
    """Run ``cmd`` from the repository root. With ``log``, its output goes to that file and the
    lines matching ``show`` are echoed; otherwise it goes straight to the terminal (progress bars
    included). A non-zero exit raises QuickstartError with the end of the log."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    say("  $ " + " ".join(_short(c) for c in cmd))
    if log is None:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        rc = _wait(proc)
        if rc:
            raise QuickstartError(f"command failed with exit code {rc}: {cmd[0]} ...")
        return
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            for line in proc.stdout:
                fh.write(line)
                if show is not None and show.search(line):
                    say("    " + _compact(line.rstrip()))
        except KeyboardInterrupt:
            _stop(proc)
            raise
        rc = _wait(proc)
    if rc:
        tail = "".join(open(log).readlines()[-25:])
        raise QuickstartError(f"command failed with exit code {rc}; end of {log}:\n{tail}")


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    """Interrupt the child (a terminal's Ctrl-C already did; a SIGTERM to us alone did not),
    give it a moment to exit cleanly, then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _short(arg: str) -> str:
    """A path relative to the current directory when it is below it, else as given."""
    if not os.path.isabs(arg):
        return arg
    rel = os.path.relpath(arg)
    return arg if rel.startswith("..") else rel


def _compact(line: str) -> str:
    """Keep the informative fields of a Megatron iteration line."""
    if "|" not in line or "validation loss" in line or "iteration" not in line:
        return line.strip().rstrip(" |")
    keep = ("iteration ", "elapsed time per iteration", "tokens per second", "ETA", "lm loss")
    fields = [f.strip() for f in line.split("|") if f.strip().startswith(keep) or "]  iter" in f]
    return " | ".join(fields)


# ---------------------------------------------------------------------------------- stages


@dataclass
class Stage:
    """One step of the pipeline: ``run(tmp)`` writes everything into ``tmp``."""

    name: str
    title: str
    key: dict
    run: Callable[[Path], str]


def _fingerprint(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_stages(stages: list[Stage], out: Path) -> None:
    """Run the stages in order, reusing each finished one whose settings did not change;
    once a stage is redone, every later stage is redone too."""
    out.mkdir(parents=True, exist_ok=True)
    redo = False
    for i, stage in enumerate(stages, 1):
        final, tmp = out / stage.name, out / f".{stage.name}.tmp"
        fp = _fingerprint(stage.key)
        header = f"[{i}/{len(stages)}] {stage.title}"
        marker = final / MARKER
        if not redo and marker.is_file():
            done = json.loads(marker.read_text())
            if done.get("fingerprint") == fp:
                say(
                    f"\n{header}: reusing the finished stage in {_short(str(final))} "
                    f"({done.get('summary', '')})"
                )
                continue
        redo = True
        say(f"\n{header} -> {_short(str(final))}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        start = time.time()
        try:
            summary = stage.run(tmp)
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            say(
                f"\ninterrupted: stage '{stage.name}' discarded (nothing half-written); "
                "rerun the same command to resume from it"
            )
            raise SystemExit(130)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        took = time.time() - start
        (tmp / MARKER).write_text(
            json.dumps({"fingerprint": fp, "summary": summary, "seconds": round(took, 1)})
        )
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        say(f"  done in {took:.0f}s: {summary}")


def _tool(s: Settings, script: str, *args: str) -> list[str]:
    return [s.python, str(ROOT / "tools" / script), *args]


def _torchrun(s: Settings, script: str, *args: str) -> list[str]:
    return [
        s.python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(s.nproc),
        str(ROOT / script),
        *args,
    ]


def build_stages(s: Settings) -> list[Stage]:
    """The pipeline for these settings (see the module docstring)."""
    out = s.out
    tok_model = out / "tokenizer" / "sp.model"
    train_prefix, valid_prefix = out / "data" / "train", out / "data" / "valid"
    tok_flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tok_model)]
    corpus_key = dict(corpus=s.corpus, valid=s.valid_corpus, mb=s.corpus_mb, seed=s.seed)

    def corpus(tmp: Path) -> str:
        if s.corpus:
            return f"using your corpus {s.corpus} (train) and {s.valid_corpus} (valid)"
        run_command(
            _tool(
                s,
                "make_sample_corpus.py",
                "--output",
                str(tmp),
                "--size-mb",
                str(s.corpus_mb),
                "--seed",
                str(s.seed),
            )
        )
        return f"sample corpus in {_short(str(out / 'corpus'))} (train/, val.jsonl.zst)"

    def train_input() -> str:
        return s.corpus or str(out / "corpus" / "train")

    def valid_input() -> str:
        return s.valid_corpus or str(out / "corpus" / "val.jsonl.zst")

    def tokenizer(tmp: Path) -> str:
        run_command(
            _tool(
                s,
                "train_tokenizer.py",
                "--input",
                train_input(),
                "--vocab-size",
                str(s.vocab_size),
                "--model-prefix",
                str(tmp / "sp"),
                "--seed",
                str(s.seed),
            ),
            log=tmp / "train_tokenizer.log",
        )
        return f"{s.vocab_size}-piece SentencePiece BPE model {_short(str(tok_model))}"

    def data(tmp: Path) -> str:
        tmp_tok = [
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tok_model),
        ]
        for split, src in (("train", train_input()), ("valid", valid_input())):
            say(f"  preprocessing the {split} split")
            run_command(
                _tool(
                    s,
                    "preprocess_data.py",
                    "--input",
                    src,
                    "--output-prefix",
                    str(tmp / split),
                    *tmp_tok,
                    "--append-eod",
                    "--workers",
                    "2",
                ),
                log=tmp / f"{split}.log",
                show=re.compile(r"done:|error"),
            )
        return f"indexed datasets {_short(str(train_prefix))}_text_document / valid_text_document"

    stages = [
        Stage("corpus", "corpus", corpus_key, corpus),
        Stage("tokenizer", "tokenizer", dict(corpus_key, vocab=s.vocab_size), tokenizer),
        Stage("data", "preprocess train/valid", dict(corpus_key, vocab=s.vocab_size), data),
    ]
    model_key = dict(
        corpus_key,
        vocab=s.vocab_size,
        iters=s.iters,
        nproc=s.nproc,
        layers=s.num_layers,
        hidden=s.hidden_size,
        heads=s.num_heads,
        seq=s.seq_length,
        mbs=s.micro_batch,
        gbs=s.global_batch,
        lr=s.lr,
        eval=(s.eval_interval, s.eval_iters),
    )
    for arm in s.arms:
        stages.append(
            Stage(
                f"train_{arm}",
                f"train {arm.upper()} ({s.iters} iterations, "
                f"{s.tokens:,} tokens, {s.nproc} CPU processes, TP={s.nproc})",
                dict(model_key, arm=arm),
                _train_stage(s, arm, tok_flags, train_prefix, valid_prefix),
            )
        )
    eval_key = dict(model_key, arms=s.arms, bins=s.bin_edges)
    stages.append(
        Stage(
            "evaluate",
            "evaluate: validation perplexity by token frequency",
            eval_key,
            lambda tmp: _evaluate(s, tmp, valid_prefix),
        )
    )
    stages.append(
        Stage(
            "report",
            "report: tables, loss curves, frequency bars",
            eval_key,
            lambda tmp: _report(s, tmp),
        )
    )
    if s.export and "lev" in s.arms:
        stages.append(
            Stage(
                "export",
                "export LEVIATHAN to Hugging Face + greedy continuation",
                dict(model_key, prompt=s.prompt),
                lambda tmp: _export(s, tmp),
            )
        )
    return stages


def _train_stage(s: Settings, arm: str, tok_flags, train_prefix: Path, valid_prefix: Path):
    def train(tmp: Path) -> str:
        warmup = max(1, s.iters // 10)
        cmd = _torchrun(
            s,
            "pretrain_leviathan.py",
            "--tensor-model-parallel-size",
            str(s.nproc),
            "--sequence-parallel",
            "--embedding-type",
            arm,
            # LEV's sizes for a D=128 model; its training controls are the project defaults.
            "--lev-num-heads",
            "4",
            "--lev-seed-dim",
            "64",
            "--lev-rank",
            "16",
            "--num-layers",
            str(s.num_layers),
            "--hidden-size",
            str(s.hidden_size),
            "--num-attention-heads",
            str(s.num_heads),
            "--seq-length",
            str(s.seq_length),
            "--micro-batch-size",
            str(s.micro_batch),
            "--global-batch-size",
            str(s.global_batch),
            "--train-iters",
            str(s.iters),
            "--lr",
            str(s.lr),
            "--min-lr",
            str(s.lr / 10),
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-iters",
            str(warmup),
            "--weight-decay",
            "0.1",
            "--clip-grad",
            "1.0",
            "--seed",
            str(s.seed),
            "--train-data-path",
            f"{train_prefix}_text_document",
            "--valid-data-path",
            f"{valid_prefix}_text_document",
            *tok_flags,
            "--log-interval",
            str(max(1, min(10, s.iters // 4))),
            "--eval-interval",
            str(min(s.eval_interval, s.iters)),
            "--eval-iters",
            str(s.eval_iters),
            "--num-workers",
            "0",
            "--save",
            str(tmp / "ckpt"),
            "--save-interval",
            str(s.iters),
            "--tensorboard-dir",
            str(tmp / "tb"),
            "--log-jsonl",
            str(tmp / "train.jsonl"),
        )
        run_command(cmd, log=tmp / "train.log", show=_SHOW)
        text = (tmp / "train.log").read_text()
        params = re.findall(r"model parameters: (\d+)", text)
        vals = re.findall(r"validation loss at iteration\s+(\d+) \| lm loss value: (\S+)", text)
        if not params or not vals:
            raise QuickstartError(
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
            f"{_short(str(s.out / f'train_{arm}' / 'ckpt'))}"
        )

    return train


def _evaluate(s: Settings, tmp: Path, valid_prefix: Path) -> str:
    loads = []
    for arm in s.arms:
        loads += ["--load", str(s.out / f"train_{arm}" / "ckpt")]
    base = "tied" if "tied" in s.arms else s.arms[0]
    run_command(
        _torchrun(
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
        ),
        log=tmp / "evaluate.log",
        show=re.compile(r"tokens in .* s \(|^\||error"),
    )
    return f"frequency table {_short(str(s.out / 'evaluate' / 'frequency' / 'frequency.md'))}"


# ---------------------------------------------------------------------------------- report


def _read_runs(out: Path, arms) -> dict[str, dict]:
    return {a: json.loads((out / f"train_{a}" / "run.json").read_text()) for a in arms}


def _all_rows(freq: dict) -> dict[str, dict]:
    """The 'all' row (every validation token) of each run in frequency.json."""
    return {row["run"]: row for row in freq["rows"] if str(row["bin"]) == "all"}


def decomposition(losses: dict[str, float]) -> Optional[list[tuple[str, str, str, float]]]:
    """Each ingredient's share of LEV's gain over ALBERT, as a reduction of validation loss in
    percent of ALBERT's loss (the three steps telescope to LEV vs ALBERT); None without the
    four arms."""
    if not all(a in losses for a in ("albert", "flat-mlp", "factored-mlp", "lev")):
        return None
    ref = losses["albert"]
    return [(name, a, b, 100.0 * (losses[a] - losses[b]) / ref) for name, a, b in DECOMPOSITION]


def _report(s: Settings, tmp: Path) -> str:
    from megatron_ext.evaluation.outputs import format_markdown_table

    base = "tied" if "tied" in s.arms else s.arms[0]
    runs_ = [f"{a}={s.out / f'train_{a}' / 'tb'}" for a in s.arms]
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
    for r in runs_:
        cmd += ["--run", r]
    run_command(cmd, log=tmp / "curves.log", show=re.compile(r"reach|error"))
    efficiency_lines = [
        ln.strip() for ln in (tmp / "curves.log").read_text().splitlines() if "reach" in ln
    ]
    freq_dir = s.out / "evaluate" / "frequency"
    shutil.copy(freq_dir / "frequency.png", tmp / "frequency.png")
    freq = json.loads((freq_dir / "frequency.json").read_text())
    alls = _all_rows(freq)
    runs = _read_runs(s.out, s.arms)

    rows, losses = [], {}
    tied_params = runs[base]["parameters"]
    for arm in s.arms:
        r, a = runs[arm], alls.get(arm, {})
        loss = float(a["loss"])
        losses[arm] = loss
        base_loss = float(alls[base]["loss"])
        rows.append(
            [
                arm.upper(),
                f"{r['parameters']:,}",
                f"{100.0 * (r['parameters'] - tied_params) / tied_params:+.1f}%",
                f"{r['final_valid_loss']:.4f}",
                f"{loss:.4f}",
                f"{math.exp(loss):.2f}",
                f"{100.0 * (math.exp(loss) / math.exp(base_loss) - 1):+.1f}%",
            ]
        )
    table = format_markdown_table(
        [
            "arm",
            "parameters",
            "vs " + base.upper(),
            "loop's valid loss",
            "valid loss (all tokens)",
            "valid perplexity",
            f"ppl vs {base.upper()}",
        ],
        rows,
    )

    md = [
        f"# {s.title}",
        "",
        f"Same backbone ({s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads, "
        f"sequence {s.seq_length}), seed {s.seed}, data order and token budget for every arm: "
        f"{s.iters} iterations x {s.global_batch} sequences = {s.tokens:,} tokens, "
        f"{s.nproc} CPU processes at TP={s.nproc}. Vocabulary: {s.vocab_size} SentencePiece "
        "pieces. Only `--embedding-type` differs.",
        "",
        "## Validation perplexity",
        "",
        "`loop's valid loss`: the training loop's last validation (its `--eval-iters` "
        "batches); the other columns score every token of the validation split "
        "(`tools/evaluate.py frequency`, row `all`).",
        "",
        table,
        "",
        "## Loss curves",
        "",
        "![loss curves](curves.png)",
        "",
    ]
    md += [
        "Sample efficiency (tokens to reach the final validation loss of "
        f"{base.upper()}, `tools/evaluate.py curves --reference {base}`):",
        "",
    ]
    md += [f"- {ln}" for ln in efficiency_lines] or ["- (no other run)"]
    md += [
        "",
        "## Frequency-stratified perplexity",
        "",
        "Validation tokens binned by their relative frequency in the training data "
        f"(edges {', '.join(f'{e:g}' for e in s.bin_edges)}; a small corpus has no tokens "
        "in the paper's rarest bins).",
        "",
        (freq_dir / "frequency.md").read_text().strip(),
        "",
        "![frequency-stratified perplexity](frequency.png)",
        "",
    ]
    parts = decomposition(losses)
    if parts is not None:
        total = sum(p[3] for p in parts)
        md += [
            "## Ablation decomposition",
            "",
            "Each step adds one ingredient of LEV (docs/lev.md section 3): ALBERT (linear "
            "compression) -> FLAT-MLP (continuous generation from a plain seed) -> "
            "FACTORED-MLP (compositional digit seed) -> LEVIATHAN (separable spline "
            "instead of an MLP). A step's share is the reduction of validation loss (all "
            "tokens) in percent of ALBERT's loss, so the three add up to LEV vs ALBERT. "
            "Paper: +1.13%, +0.37%, +0.62%.",
            "",
            format_markdown_table(
                ["ingredient", "from", "to", "loss reduction"],
                [[n, a.upper(), b.upper(), f"{v:+.2f}%"] for n, a, b, v in parts]
                + [["total (LEV vs ALBERT)", "ALBERT", "LEVIATHAN", f"{total:+.2f}%"]],
            ),
            "",
        ]
    md += [
        "## Files",
        "",
        f"- checkpoints: {', '.join(f'`train_{a}/ckpt`' for a in s.arms)} "
        "(TensorBoard in `train_<arm>/tb`, full logs in `train_<arm>/train.log`)",
        "- `evaluate/frequency/frequency.{md,csv,json,png}`",
        "- `report/curves.png`, `report/frequency.png`, `report/sample_efficiency.md`",
        "",
    ]
    summary = {
        "runs": runs,
        "valid_loss_all_tokens": losses,
        "decomposition": parts,
        "sample_efficiency": efficiency_lines,
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
    (tmp / "report.md").write_text("\n".join(md))
    return f"{_short(str(s.out / 'report' / 'report.md'))} with curves.png and frequency.png"


# ---------------------------------------------------------------------------------- export


def _export(s: Settings, tmp: Path) -> str:
    run_command(
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    ids = tokenizer(s.prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    (tmp / "continuation.txt").write_text(text + "\n")
    say("  " + text.replace("\n", " "))
    return f"Hugging Face model {_short(str(s.out / 'export' / 'hf'))}"


# ---------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> tuple[Settings, bool]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.add_argument("--arms", nargs="+", default=["tied", "lev"], choices=ALL_ARMS)
    p.add_argument("--iters", type=int, default=150, help="training iterations per arm")
    p.add_argument("--nproc", type=int, default=2, help="CPU processes (= TP size)")
    p.add_argument("--corpus", help="your training jsonl file or directory (default: sample)")
    p.add_argument("--valid-corpus", help="your validation jsonl file (with --corpus)")
    p.add_argument("--corpus-mb", type=float, default=4.0, help="size of the sample corpus")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export")
    p.add_argument("--title", default="Quick start: TIED vs LEVIATHAN")
    p.add_argument("--fresh", action="store_true", help="delete OUT and start over")
    a = p.parse_args(argv)
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
    return s, a.fresh


def main(argv=None) -> int:
    s, fresh = parse_args(argv)
    if fresh and s.out.exists():
        say(f"--fresh: removing {_short(str(s.out))}")
        shutil.rmtree(s.out)
    # Ctrl-C and SIGTERM discard the running stage, also when started where SIGINT is ignored
    # (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    start = time.time()
    try:
        run_stages(build_stages(s), s.out)
    except QuickstartError as e:
        say(f"\nerror: {e}")
        say("rerun the same command to retry from the failed stage")
        return 1
    report = s.out / "report" / "report.md"
    say(f"\nall stages done in {time.time() - start:.0f}s. Open:")
    say(f"  {_short(str(report))}   (comparison table, loss curves, frequency bars)")
    say(
        f"  {_short(str(s.out / 'report' / 'curves.png'))}, "
        f"{_short(str(s.out / 'report' / 'frequency.png'))}"
    )
    if (s.out / "export" / "hf").is_dir():
        say(
            f"  {_short(str(s.out / 'export' / 'hf'))}   (AutoModelForCausalLM.from_pretrained; "
            f"continuation in {_short(str(s.out / 'export' / 'continuation.txt'))})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
