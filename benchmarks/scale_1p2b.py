"""The paper's 1.2B shape on this CPU: every stage at real width and vocabulary, memory as planned.

Per arm (LEV, TIED): `examples/recipes/pretrain.sh 1.2b ARM` on 2 gloo ranks at TP=2, o200k,
KJV text, --num-layers of 16; then resume (bit-identical), reshard, export, hf-logits, evaluate
and generate, each with its wall time and each rank's peak resident memory beside what
`megatron_ext.models.memory` plans. Needs `pip install -e .[scale]`; run it alone:

    python benchmarks/scale_1p2b.py --num-layers 8              # the real shape, 8 of 16 layers
    python benchmarks/scale_1p2b.py --num-layers 1 --hidden-size 64 --ffn-hidden-size 128 \\
        --num-attention-heads 4 --seq-length 64                 # shrunk (tests/benchmarks)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_train_step import lev_seconds  # noqa: E402
from benchmarks.harness import add_defaults  # noqa: E402
from megatron_ext._paths import atomic_write  # noqa: E402
from megatron_ext.launch import find_free_port, job_environment  # noqa: E402
from tests.support.jobs import Job  # noqa: E402

# tiktoken's published digest of openaipublic's o200k_base.tiktoken.
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
GIB = 1024**3
say = functools.partial(print, flush=True)  # a progress line, printed now
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|")
_SAVED = re.compile(r"saved checkpoint at iteration (\d+)")


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes ({} once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM") if k in fields}


class PeakMemory:
    """Peak resident memory of a job's ranks, by phase: a thread samples VmHWM of every rank
    every 50 ms; `phase(name)` closes the current phase (a last sample, then the high-water
    marks are reset) and opens the next. `peaks[phase][rank]` is in bytes, `seconds[phase]` the
    phase's wall time; `runtime[rank]` is the resident size when `mark_runtime` was called."""

    def __init__(self, job: Job, first_phase: str) -> None:
        self.job, self.current = job, first_phase
        self.peaks: dict[str, dict[int, int]] = {}
        self.runtime: dict[int, int] = {}
        self.seconds: dict[str, float] = {}
        self._since = time.monotonic()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for rank, pid in self.job.ranks().items():
            hwm = _status(pid).get("VmHWM")
            if hwm is not None:
                phase = self.peaks.setdefault(self.current, {})
                phase[rank] = max(phase.get(rank, 0), hwm)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._sample()
            self._stop.wait(0.05)

    def _end_phase(self) -> None:
        now = time.monotonic()
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._since
        self._since = now

    def phase(self, name: str) -> None:
        """Close the current phase and open `name` (a phase seen before is continued)."""
        with self._lock:
            self._sample()
            self._end_phase()
            for pid in self.job.ranks().values():  # VmHWM back to VmRSS (proc(5), clear_refs)
                with contextlib.suppress(OSError):
                    Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.current = name

    def mark_runtime(self) -> None:
        """Record each rank's resident size now (before it builds a model)."""
        with self._lock:
            for rank, pid in self.job.ranks().items():
                self.runtime[rank] = _status(pid).get("VmRSS", 0)

    def close(self) -> None:
        """Stop sampling (call once the job has exited; the last phase ends then)."""
        self._stop.set()
        self._thread.join()
        self._end_phase()


@dataclass
class StageResult:
    """One measured stage: wall seconds, peak bytes per rank, and the planned bytes."""

    arm: str
    stage: str
    seconds: float
    peaks: dict[int, int]
    planned: Optional[int] = None
    note: str = ""

    @classmethod
    def of(cls, arm, stage, memory: PeakMemory, phase=None, planned=None, note=""):
        """`stage` measured by `memory`: its `phase`, or (None) every phase: their seconds
        summed, each rank's highest peak; printed as it is made."""
        if phase is None:
            seconds = sum(memory.seconds.values())
            ranks = sorted({r for peaks in memory.peaks.values() for r in peaks})
            peaks = {r: max(p.get(r, 0) for p in memory.peaks.values()) for r in ranks}
        else:
            seconds, peaks = memory.seconds.get(phase, 0), memory.peaks[phase]
        result = cls(arm, stage, seconds, peaks, planned, note)
        say(result.line())
        return result

    def line(self) -> str:
        """The stage's progress line."""
        peak = ", ".join(f"rank {r} {b / GIB:.2f} GiB" for r, b in sorted(self.peaks.items()))
        text = f"[{self.arm}] {self.stage:10s} {self.seconds:8.1f} s   peak {peak}"
        if self.planned is not None:
            worst = max(self.peaks.values())
            text += (
                f"   planned {self.planned / GIB:.2f} GiB (measured / planned "
                f"{worst / self.planned:.3f})"
            )
        return text + (f"   {self.note}" if self.note else "")


def o200k_tokenizer(out: Path) -> Path:
    """OpenAI's o200k_base.tiktoken as shipped (gzipped) by the bpe-openai package, checked
    against tiktoken's published SHA-256."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None:
        sys.exit("scale_1p2b: the o200k vocabulary is missing; pip install -e '.[scale]'")
    packed = Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz"
    target = out / "o200k_base.tiktoken"
    if not target.is_file():
        data = gzip.decompress(packed.read_bytes())
        digest = hashlib.sha256(data).hexdigest()
        if digest != O200K_SHA256:
            sys.exit(f"scale_1p2b: {packed} is not OpenAI's o200k_base (sha256 {digest})")
        atomic_write(target, data)
    return target


def kjv_corpus(out: Path, held_out: int) -> tuple[Path, Path]:
    """(training jsonl, held-out jsonl of the last `held_out` chapters) of the KJV."""
    from benchmarks.make_kjv_corpus import chapters

    train, valid = out / "kjv_train.jsonl", out / "kjv_heldout.jsonl"
    if not train.is_file():
        docs = chapters()
        for path, part in ((valid, docs[-held_out:]), (train, docs[:-held_out])):
            atomic_write(path, "".join(json.dumps(d) + "\n" for d in part))
    return train, valid


def _tool(args: argparse.Namespace, script: str, *argv: str) -> list[str]:
    return [args.python, str(REPO / "tools" / script), *argv]


def run_measured(
    cmd: list[str], log: Path, nproc: int, first_phase: str, on_line=None, env=None
) -> PeakMemory:
    """Run `cmd` (torchrun inside when nproc > 1) and sample its ranks' memory by phase;
    `on_line(line, memory)` sees each line of its output."""
    env = job_environment(env)
    job = Job(cmd, log_path=log, env=env, cwd=REPO, torchrun=nproc > 1, timeout=7200)
    with job:
        memory = PeakMemory(job, first_phase)
        try:
            code = job.wait(on_line=(lambda line: on_line(line, memory)) if on_line else None)
        finally:
            memory.close()
    if code != 0:
        tail = log.read_text(errors="replace")[-5000:]
        sys.exit(f"scale_1p2b: {' '.join(cmd)} failed ({code}):\n{tail}")
    return memory


def _torchrun(args: argparse.Namespace, nproc: int) -> list[str]:
    port = str(find_free_port())
    return [args.python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", port]  # fmt: skip


def _phase_peaks(memory: PeakMemory) -> str:
    """'phase a.aa/b.bb GiB, ...' (the ranks' peaks of each phase)."""
    return ", ".join(
        f"{phase} " + "/".join(f"{b / GIB:.2f}" for _, b in sorted(peaks.items())) + " GiB"
        for phase, peaks in memory.peaks.items()
    )


def _export_phases(line: str, memory: PeakMemory) -> None:
    """export-hf's phases: start (imports), load (build and load at TP=1), then the table and
    the write."""
    if "loading" in line:
        memory.mark_runtime()
        memory.phase("load")
    elif line.split("] ", 1)[-1].startswith("loaded "):
        memory.phase("table+write")


def train_phases(save_iterations: set[int], resuming: bool):
    """The on_line callback that splits a training run into phases from its log: build (until
    the model is built), load (resuming), train, and save (each checkpoint write)."""

    def on_line(line: str, memory: PeakMemory) -> None:
        if "layout: world" in line:
            memory.mark_runtime()
        elif "model parameters:" in line:
            memory.phase("load" if resuming else "train")
        elif resuming and "loaded checkpoint" in line:
            memory.phase("train")
        elif (m := _ITERATION.search(line)) and int(m.group(1)) in save_iterations:
            memory.phase("save")
        elif _SAVED.search(line):
            memory.phase("train")

    return on_line


def recipe_run(
    args: argparse.Namespace, arm: str, runs: Path, data: Path, tok_dir: Path, extra: list[str]
) -> tuple[PeakMemory, Path, Path]:
    """`examples/recipes/pretrain.sh 1.2b ARM` at this machine's layout; (memory, log, jsonl)."""
    runs.mkdir(parents=True, exist_ok=True)
    log, jsonl = runs / "train.log", runs / "train.jsonl"
    launch = " ".join(_torchrun(args, 2))
    env = {
        "DATA_DIR": str(data), "TOKENIZER_DIR": str(tok_dir), "RUNS_DIR": str(runs),
        "LAUNCH": launch, "TP": "2", "MBS": "1", "PATH": f"{Path(args.python).parent}:"
        + os.environ.get("PATH", ""),
    }  # fmt: skip
    flags = [
        *args.shape_flags, "--global-batch-size", str(args.global_batch_size),
        "--train-samples", str(args.iters * args.global_batch_size),
        "--save-interval", str(args.save_interval), "--num-workers", "0",
        "--log-interval", "1", "--timing-log-level", "2", "--log-jsonl", str(jsonl),
        "--eval-interval", str(10**6), "--eval-iters", "0", "--no-loss-curve",
        "--ckpt-keep-last", "2", *extra,
    ]  # fmt: skip
    cmd = ["bash", str(REPO / "examples" / "recipes" / "pretrain.sh"), "1.2b", arm, *flags]
    saves = set(range(args.save_interval, args.iters + 1, args.save_interval)) | {args.iters}
    resuming = "--ckpt-step" in extra
    memory = run_measured(cmd, log, 2, "build", on_line=train_phases(saves, resuming), env=env)
    return memory, log, jsonl


def records(jsonl: Path) -> dict[int, dict]:
    """The --log-jsonl records by iteration."""
    lines = filter(str.strip, jsonl.read_text().splitlines())
    return {int(record["iteration"]): record for record in map(json.loads, lines)}


def compare_checkpoints(a: Path, b: Path, prefix: str = "model.") -> tuple[int, list[str]]:
    """(tensors compared, names that differ) between two DCP checkpoints, key by key."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = [FileSystemReader(str(path)).read_metadata().state_dict_metadata for path in (a, b)]
    keys = sorted(k for k in meta[0] if k.startswith(prefix))
    differ = []
    for key in keys:
        item = meta[0][key]
        if key not in meta[1]:
            differ.append(key)
        elif isinstance(item, TensorStorageMetadata):
            pair = [torch.empty(item.size, dtype=item.properties.dtype) for _ in (a, b)]
            for tensor, path in zip(pair, (a, b)):
                dcp.load({key: tensor}, checkpoint_id=str(path), no_dist=True)
            if not torch.equal(*pair):
                differ.append(key)
    return len(keys), differ


def logits_check(hf_dir: str, ckpt: str, data_prefix: str, window: int) -> dict:
    """The export's logits (transformers, float32) against our TP=1 model's on the first
    `window` tokens of a held-out document; runs in its own process (a measured stage)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_ext.data.indexed import load_dataset
    from megatron_ext.inference import loading

    dataset = load_dataset(data_prefix)  # its memory map lives as long as it does
    ids = torch.as_tensor(dataset[0][:window].astype("int64"))[None]
    del dataset
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        theirs = hf(ids).logits[0].float()
        del hf
        pg = loading.init_inference_parallel(1, 1)
        run = loading.find_checkpoint(ckpt)
        model = loading.load_model(run, loading.run_model_config(run), pg)
        ours = model(ids, None, None, runtime_gather_output=True)[0].float()
    vocab = theirs.shape[-1]  # the export trims the padding rows
    ours = ours[:, :vocab]
    scale = ours.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    return dict(
        tokens=ids.shape[1],
        vocab=vocab,
        max_abs_diff=diff,
        rel_max_diff=diff / scale,
        argmax_agree=float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    )


def planned(args: argparse.Namespace, arm: str, vocab: int) -> tuple[dict[str, int], int]:
    """(bytes per rank that `megatron_ext.models.memory` plans for the measured stages, tensors
    only: the caller adds the measured runtime; the model's parameters by `count_parameters`)."""
    from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models import count_parameters, memory

    cfg = ModelConfig(
        vocab_size=vocab, seq_length=args.seq_length, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, embedding=dict(embedding_type=arm),
    )  # fmt: skip
    layout = memory.TrainingPlan(
        parallel=ParallelConfig(
            tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True
        ),
        precision=PrecisionConfig(bf16=True),
        micro_batch_size=1,
    )
    plan = dict(
        train=memory.estimate_memory(cfg, layout).total,
        save=memory.estimate_save_memory(cfg, layout),
        export=memory.estimate_export_memory(cfg, exported_vocab=args.tokenizer_vocab),
    )
    return plan, count_parameters(cfg).total


def _ckpt(runs: Path, arm: str) -> Path:
    """The checkpoint directory of the recipe's run in `runs`."""
    return runs / f"{arm}-1.2b-o200k" / "ckpt"


def train_stages(args, arm: str, out: Path, data: Path, tok_dir: Path):
    """build, train, save (the recipe's run, saving every --save-interval and at the end) and
    resume (from the middle checkpoint to the end, no optimizer state in its own save):
    (StageResults, step seconds, LEV's seconds, whether the counts agree and the resume is
    bit-identical)."""
    mem, log, jsonl = recipe_run(args, arm, out / "run", data, tok_dir, [])
    plan, counted = planned(args, arm, args.padded_vocab)
    logged = int(re.search(r"model parameters: (\d+)", log.read_text()).group(1))
    runtime = max(mem.runtime.values())
    losses = records(jsonl)
    step = statistics.median(r["seconds"] for r in losses.values())
    count = f"count_params {counted:,}: {'equal' if logged == counted else 'DIFFERENT'}"
    note = f"runtime {runtime / GIB:.2f} GiB, {step:.1f} s/iteration"
    results = [
        StageResult.of(arm, "build", mem, "build", note=f"model parameters {logged:,} ({count})"),
        StageResult.of(arm, "train", mem, "train", plan["train"] + runtime, note),
        StageResult.of(arm, "save", mem, "save", plan["save"] + runtime),
    ]
    times = [r["seconds"] for _, r in sorted(losses.items())]
    lev = lev_seconds(log.read_text())
    middle = args.iters - args.save_interval
    ckpt = _ckpt(out / "run", arm)
    mem, _, jsonl = recipe_run(
        args, arm, out / "resume", data, tok_dir,
        ["--load", str(ckpt), "--ckpt-step", str(middle), "--no-save-optim"],
    )  # fmt: skip
    resumed = records(jsonl)
    steps_same = all(
        (resumed[i]["loss"], resumed[i]["grad_norm"]) == (losses[i]["loss"], losses[i]["grad_norm"])
        for i in range(middle + 1, args.iters + 1)
    )
    final = f"iter_{args.iters:07d}"
    compared, differ = compare_checkpoints(ckpt / final, _ckpt(out / "resume", arm) / final)
    results.append(StageResult.of(
        arm, "resume", mem,
        note=f"peaks by phase: {_phase_peaks(mem)}; iterations {middle + 1}-{args.iters}: "
        f"loss and grad norm {'bit-identical' if steps_same else 'DIFFER'}; "
        f"{compared} parameters at iteration {args.iters}: "
        f"{'bit-identical' if not differ else 'DIFFER: ' + ', '.join(differ[:4])}",
    ))  # fmt: skip
    shutil.rmtree(out / "resume")
    return results, times, lev, steps_same and not differ and logged == counted


def convert_stages(args, arm: str, out: Path, data: Path) -> tuple[list[StageResult], dict]:
    """reshard to TP=1 (weights only), export-hf, the export's logits through transformers:
    (StageResults, the logits check)."""
    plan, _ = planned(args, arm, args.padded_vocab)
    tp1, hf = out / "tp1", out / "hf"
    mem = run_measured(
        _tool(args, "convert_checkpoint.py", "reshard", "--load", str(_ckpt(out / "run", arm)),
              "--output", str(tp1), "--target-tensor-parallel-size", "1", "--no-optimizer",
              "--no-progress"),
        out / "reshard.log", 1, "reshard",
    )  # fmt: skip
    results = [StageResult.of(arm, "reshard", mem, "reshard")]
    # The tokenizer's own export (o200k: about 13 s, tests/conversion/test_hf_tokenizer.py)
    # stays out of the measured stage: the figures are the model's.
    mem = run_measured(
        _tool(args, "convert_checkpoint.py", "export-hf", "--load", str(tp1), "--output",
              str(hf), "--no-progress", "--no-tokenizer"),
        out / "export.log", 1, "start", on_line=_export_phases,
    )  # fmt: skip
    runtime = max(mem.runtime.values()) if mem.runtime else 0
    note = f"runtime {runtime / GIB:.2f} GiB; peaks by phase: {_phase_peaks(mem)}"
    results.append(StageResult.of(arm, "export", mem, None, plan["export"] + runtime, note))
    check = out / "logits.json"
    mem = run_measured(
        [args.python, __file__, "--logits-check", str(hf), str(tp1),
         str(data / "heldout_text_document"), str(check), "--seq-length", str(args.seq_length)],
        out / "logits.log", 1, "hf-logits",
    )  # fmt: skip
    logit = json.loads(check.read_text())
    results.append(StageResult.of(
        arm, "hf-logits", mem, "hf-logits",
        note=f"{logit['tokens']} tokens x {logit['vocab']} ids: max |diff| "
        f"{logit['max_abs_diff']:.2e} (relative {logit['rel_max_diff']:.2e}), "
        f"argmax agrees on {100 * logit['argmax_agree']:.0f}%",
    ))  # fmt: skip
    return results, logit


def serve_stages(args, arm: str, out: Path, heldout: Path) -> list[StageResult]:
    """evaluate (perplexity on the held-out chapters) and generate, at the training layout."""
    ckpt = str(_ckpt(out / "run", arm))
    mem = run_measured(
        [*_torchrun(args, 2), str(REPO / "tools" / "evaluate.py"), "perplexity", "--load",
         ckpt, "--text", str(heldout), "--tensor-model-parallel-size", "2",
         "--micro-batch-size", "1", "--no-progress", "--output-dir", str(out / "ppl")],
        out / "evaluate.log", 2, "evaluate",
    )  # fmt: skip
    ppl = json.loads((out / "ppl" / "perplexity.json").read_text())
    note = (
        f"perplexity {ppl.get('perplexity', float('nan')):.1f} over {ppl.get('tokens', '?')} tokens"
    )
    results = [StageResult.of(arm, "evaluate", mem, "evaluate", note=note)]
    generated = out / "generated.jsonl"
    mem = run_measured(
        [*_torchrun(args, 2), str(REPO / "tools" / "generate.py"), "--load", ckpt,
         "--prompt", args.prompt, "--max-new-tokens", "16", "--no-stop-at-eod",
         "--tensor-model-parallel-size", "2", "--output", str(generated)],
        out / "generate.log", 2, "generate",
    )  # fmt: skip
    completion = json.loads(generated.read_text().splitlines()[0])
    note = f"{len(completion['completion_ids'])} tokens: {completion['completion']!r}"
    return results + [StageResult.of(arm, "generate", mem, "generate", note=note)]


def run_arm(args: argparse.Namespace, arm: str, data: Path, tok_dir: Path, heldout: Path):
    """Every stage of one arm: (StageResults, step seconds, LEV's seconds, whether every
    correctness check passed but the logits', the logits check)."""
    out = args.out / arm
    if out.exists():
        shutil.rmtree(out)
    results, times, lev, identical = train_stages(args, arm, out, data, tok_dir)
    converted, logit = convert_stages(args, arm, out, data)
    results += converted + serve_stages(args, arm, out, heldout)
    if not args.keep:
        for name in ("run", "tp1", "hf"):
            shutil.rmtree(out / name)
    return results, times, lev, identical, logit


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/scale_1p2b"))
    p.add_argument("--arms", nargs="+", default=["lev", "tied"], choices=("lev", "tied"))
    p.add_argument("--num-layers", type=int, default=8, help="of the recipe's 16")
    add_defaults(p, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, seq_length=512)
    add_defaults(p, global_batch_size=1, iters=4)
    p.add_argument("--save-interval", type=int, default=2, help="also the resume point")
    p.add_argument("--held-out", type=int, default=4, help="chapters held out (evaluate)")
    add_defaults(p, prompt="In the beginning God created", python=sys.executable)
    p.add_argument("--keep", action="store_true", help="keep checkpoints and exports")
    p.add_argument("--logits-check", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.save_interval < args.iters:
        p.error("--save-interval must be below --iters (the resume starts there)")
    args.out = args.out.resolve()
    args.shape_flags = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--ffn-hidden-size", str(args.ffn_hidden_size),
        "--num-attention-heads", str(args.num_attention_heads), "--seq-length",
        str(args.seq_length),
    ]  # fmt: skip
    return args


def prepare(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The o200k tokenizer (setting args.tokenizer_vocab and args.padded_vocab) and the KJV
    datasets under --out: (dataset directory, tokenizer directory, held-out jsonl)."""
    from megatron_ext.config.data import padded_vocab_size
    from megatron_ext.data.tokenizers import TikTokenizer

    tok_dir = args.out / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_file = o200k_tokenizer(tok_dir)
    args.tokenizer_vocab = TikTokenizer(str(tokenizer_file)).vocab_size
    args.padded_vocab = padded_vocab_size(args.tokenizer_vocab, 128, 2)
    train_text, heldout = kjv_corpus(args.out, args.held_out)
    data = args.out / "data"
    if not (data / "pile_o200k_text_document.idx").is_file():
        data.mkdir(exist_ok=True)
        for prefix, text in (("pile_o200k", train_text), ("heldout", heldout)):
            run_measured(
                _tool(args, "preprocess_data.py", "--input", str(text), "--tokenizer-type",
                      "TikTokenizer", "--tokenizer-model", str(tokenizer_file),
                      "--append-eod", "--output-prefix", str(data / prefix), "--workers", "1"),
                args.out / f"preprocess_{prefix}.log", 1, "preprocess",
            )  # fmt: skip
    return data, tok_dir, heldout


def report(args: argparse.Namespace, summary: dict) -> bool:
    """Print the ratios and the table, write results.json; whether every check passed. The
    exit status covers correctness; the memory ratios are reported (at a shrunk shape the
    runtime dwarfs the tensors, so 10% holds only at the real width)."""
    ok = True
    report = {"arms": {}, "layers": args.num_layers, "hidden": args.hidden_size}
    for arm, (results, times, lev, identical, logit) in summary.items():
        ok &= identical and logit["rel_max_diff"] < 1e-3
        report["arms"][arm] = dict(
            stages={r.stage: dict(seconds=r.seconds, peaks=r.peaks, planned=r.planned,
                                  note=r.note) for r in results},
            step_seconds=times, lev_seconds=lev, resume_identical=identical, logits=logit,
        )  # fmt: skip
        for r in results:
            if r.planned is not None:
                ratio = max(r.peaks.values()) / r.planned
                say(
                    f"[{arm}] {r.stage}: measured / planned {ratio:.3f} "
                    f"({'within' if abs(ratio - 1) <= 0.1 else 'NOT within'} 10%)"
                )
    if "lev" in summary:
        _, times, lev, _, _ = summary["lev"]
        steady = list(zip(times, lev))[1:] or list(zip(times, lev))
        step = statistics.median(t for t, _ in steady)
        share = statistics.median(o / t for t, o in steady)
        say(
            f"LEV's own time (lev-forward + lev-backward): median "
            f"{1000 * statistics.median(o for _, o in steady):.0f} ms of a "
            f"{step:.1f} s step = {100 * share:.2f}%"
        )
        if "tied" in summary:
            tied = statistics.median(summary["tied"][1][1:] or summary["tied"][1])
            say(f"LEV / TIED step time: {step / tied:.3f}")
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    say("\n| arm | stage | time (s) | peak per rank (GiB) | planned (GiB) | measured / planned |")
    say("|---|---|---|---|---|---|")
    for arm, (results, *_rest) in summary.items():
        for r in results:
            peaks = " / ".join(f"{b / GIB:.2f}" for _, b in sorted(r.peaks.items()))
            plan = f"{r.planned / GIB:.2f}" if r.planned else ""
            ratio = f"{max(r.peaks.values()) / r.planned:.3f}" if r.planned else ""
            say(f"| {arm} | {r.stage} | {r.seconds:.1f} | {peaks} | {plan} | {ratio} |")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.logits_check:
        hf, ckpt, data, out = args.logits_check
        Path(out).write_text(json.dumps(logits_check(hf, ckpt, data, args.seq_length)))
        return 0
    started = time.monotonic()
    data, tok_dir, heldout = prepare(args)
    say(
        f"1.2B recipe shape: {args.num_layers} of 16 layers, hidden {args.hidden_size}, "
        f"ffn {args.ffn_hidden_size}, {args.num_attention_heads} heads, sequence "
        f"{args.seq_length}, o200k ({args.tokenizer_vocab} ids, padded to "
        f"{args.padded_vocab}); 2 ranks, TP=2 + sequence parallel, micro-batch 1, global "
        f"batch {args.global_batch_size}, {args.iters} iterations, KJV text"
    )
    summary = {arm: run_arm(args, arm, data, tok_dir, heldout) for arm in args.arms}
    ok = report(args, summary)
    say(
        f"done in {time.monotonic() - started:.0f} s: "
        f"{'every check passed' if ok else 'SOME CHECK FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
