"""The GPU check: correctness of the GPU paths, then 1.2B throughput, into one JSON file.

Run through `scripts/gpu_check.sh`. Phase 1 (checks): the Triton LEV kernel against torch, the
TE spec against the local spec, FP8 steps, the two engines' losses, the GPU-side pytest files.
Phase 2 (throughput): 1.2B LEVIATHAN and TIED, BF16 then FP8, at the largest micro-batch that
fits: tokens/s, TFLOP/s, MFU and the ratios. Every phase records "pass", "fail" or "skipped"
(a phase that would overrun --time-budget-s); --cpu-dry-run runs the rest on a tiny model.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Optional

from megatron_ext._paths import atomic_write
from megatron_ext.cli import quiet_import_warnings, run_tool
from megatron_ext.config.flags import ArgumentParser

# Without megatron-core's import-time notes that Apex / TE are missing (environment() records
# whether TE is there): `--help` prints its usage and nothing before it.
with warnings.catch_warnings():
    quiet_import_warnings()
    import megatron_ext.megatron_import  # noqa: F401

    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.config.model import MODEL_SIZE_PRESETS, ModelConfig
    from megatron_ext.launch import PACKAGE_ROOT, launch
    from megatron_ext.lev import LEVConfig, LEVEmbedding
    from megatron_ext.lev.kernels import lev_modes
    from megatron_ext.models.memory import TrainingPlan, estimate_memory, flops_per_token
    from megatron_ext.models.te_check import compare_te_and_local_logits
    from megatron_ext.training.metrics import peak_tflops

# The GPU-side pytest files run from the source checkout holding this package (when there).
REPO = PACKAGE_ROOT

# o200k_base (200,019 ids) padded to a multiple of 128, the paper's 1.2B vocabulary.
PAPER_VOCAB = 200064
_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


class Budget:
    """Wall-clock budget shared by the phases."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left."""
        return self.deadline - time.monotonic()


def _log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _write_json(path: Path, payload: dict) -> None:
    atomic_write(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def _run_phase(name: str, results: dict, budget: Budget, need_s: float, fn: Callable[[], dict]):
    if budget.left() < need_s:
        results[name] = dict(status="skipped", reason=f"time budget: {budget.left():.0f}s left")
        _log(f"{name}: skipped (time budget)")
        return
    start = time.monotonic()
    try:
        outcome = fn()
    except Exception as error:  # one failing phase must not hide the others
        outcome = dict(status="fail", error=f"{type(error).__name__}: {error}")
        traceback.print_exc()
    outcome["seconds"] = round(time.monotonic() - start, 1)
    results[name] = outcome
    _log(f"{name}: {outcome.get('status')} {json.dumps(outcome)[:300]}")


# ----------------------------------------------------------------------------- environment


def environment() -> dict:
    """Date, host, versions, device and commit of this check."""
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    if torch.cuda.is_available():
        info["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30)
    for package in ("transformer_engine", "triton", "apex", "megatron.core"):
        try:
            module = __import__(package, fromlist=["__version__"])
            info[package] = getattr(module, "__version__", "present")
        except Exception:
            info[package] = None
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        info["commit"] = os.environ.get("LEVIATHAN_COMMIT", "unknown")
    return info


# ----------------------------------------------------------------------------- checks


def check_triton(device: str) -> dict:
    """Triton kernel vs the torch fused path: outputs and all six LEV parameter gradients."""

    fused_lev_modes = functools.partial(lev_modes, kernel="torch")
    triton_lev_modes = functools.partial(lev_modes, kernel="triton")
    big = device == "cuda"
    n, h, d, kappa, r = (4096, 8, 128, 16, 64) if big else (40, 2, 8, 6, 16)
    gen = torch.Generator().manual_seed(0)

    def draw(*shape, std=1.0, mean=0.0):
        x = mean + std * torch.randn(*shape, generator=gen)
        return x.to(device).requires_grad_()

    inputs = [
        draw(n, d),
        draw(h, d, d, std=0.1),
        draw(h, d, mean=1.0, std=0.3),
        draw(h, d, std=0.3),
        draw(h, d, kappa, r, std=0.1),
    ]
    # The kernels read tau, kappa, the eps values and the basis normalisation; not V or D.
    kcfg = LEVConfig(vocab_size=1, hidden_size=1, num_knots=kappa)
    out = triton_lev_modes(*inputs, kcfg)
    ref = fused_lev_modes(*inputs, kcfg)
    weight = torch.randn_like(ref)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    errors = {"modes": _relative_error(out, ref)}
    for name, g, rg in zip(("z", "seed_proj", "norm_w", "norm_b", "delta"), grads, ref_grads):
        errors[name] = _relative_error(g, rg)
    # bf16 parameters through the module (dedup, codebook gradient): triton vs torch.
    vocab = 5000 if big else 60
    tcfg = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
    )
    ids = torch.randint(0, vocab, (4, 64 if big else 8), generator=gen).to(device)
    grads_bf16 = {}
    outs = {}
    for kernel in ("triton", "torch"):
        torch.manual_seed(0)
        lcfg = LEVConfig(vocab_size=vocab, hidden_size=64, num_heads=2, rank=16, kernel=kernel)
        module = LEVEmbedding(lcfg, config=tcfg).to(device)
        outs[kernel] = module(ids)
        outs[kernel].float().square().sum().backward()
        grads_bf16[kernel] = {k: p.grad.float() for k, p in module.named_parameters()}
    errors["bf16_embedding"] = _relative_error(outs["triton"].float(), outs["torch"].float())
    for name, g in grads_bf16["triton"].items():
        errors[f"bf16_{name}"] = _relative_error(g, grads_bf16["torch"][name])
    speed = None
    if big:  # fwd+bwd time of the torch fused path over the Triton kernels, best of 5
        speed = _best_time(fused_lev_modes, inputs, kcfg) / _best_time(
            triton_lev_modes, inputs, kcfg
        )
    float32_ok = all(v <= 1e-5 for k, v in errors.items() if not k.startswith("bf16"))
    bf16_ok = all(v <= 2**-7 for k, v in errors.items() if k.startswith("bf16"))
    return dict(
        status="pass" if float32_ok and bf16_ok else "fail",
        max_relative_error=errors,
        tolerance=dict(float32=1e-5, bf16=2**-7),
        shape=dict(n=n, heads=h, seed_dim=d, knots=kappa, rank=r),
        torch_over_triton_time=speed,
    )


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def _best_time(fn, inputs, lev_config, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps + 1):  # the first call compiles / warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs, lev_config).sum().backward()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _pretrain(flags: list[str], jsonl: str, ranks: int = 1, timeout: float = 300) -> dict:
    """Run pretrain_leviathan; returns rc, the per-step records and the output tail."""
    common = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0",
              "--eval-iters", "0", "--no-loss-curve", "--log-jsonl", jsonl, "--lr", "3e-4",
              "--lr-warmup-iters", "2", "--seed", "1234", "--hidden-dropout", "0.0",
              "--attention-dropout", "0.0"]  # fmt: skip
    _log("run: pretrain_leviathan " + " ".join(shlex.quote(c) for c in flags))
    log = Path(jsonl).with_suffix(".log")
    # The ranks keep the caller's thread settings (OMP_NUM_THREADS is not forced to 1).
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    with launch("pretrain_leviathan", ranks, [*common, *flags], env=env, log=log) as job:
        try:
            rc = job.wait(timeout=timeout)
            tail = job.output()[-4000:]
        except TimeoutError as error:
            rc, tail = 124, str(error)[-2000:]
    records = []
    if os.path.exists(jsonl):
        with open(jsonl) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    return dict(rc=rc, records=records, tail=tail)


def _small_model_flags(dry: bool) -> list[str]:
    if dry:
        return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64", "--vocab-size", "512", "--lev-seed-dim", "16",
                "--lev-rank", "8", "--lev-num-heads", "2"]  # fmt: skip
    return ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8",
            "--seq-length", "1024", "--vocab-size", "32000"]  # fmt: skip


def _falling(losses: list[float]) -> bool:
    k = max(1, len(losses) // 4)
    return statistics.mean(losses[-k:]) < statistics.mean(losses[:k])


def check_fp8(workdir: str, dry: bool) -> dict:
    """20 FP8 (hybrid) steps of a small TE model: finite and falling loss."""
    flags = [*_small_model_flags(dry), "--micro-batch-size", "4", "--global-batch-size", "4",
             "--train-iters", "20", "--log-interval", "10", "--bf16",
             "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"]  # fmt: skip
    run = _pretrain(flags, os.path.join(workdir, "fp8.jsonl"))
    losses = [r["loss"] for r in run["records"]]
    finite = all(map(math.isfinite, losses))
    ok = run["rc"] == 0 and len(losses) == 20 and finite and _falling(losses)
    out = dict(status="pass" if ok else "fail", losses=losses)
    if not ok:
        out["tail"] = run["tail"]
    return out


def check_engines(workdir: str, dry: bool) -> dict:
    """Portable engine vs megatron-core's engine (--ddp-impl megatron): 20 steps, same losses."""
    base = [*_small_model_flags(dry), "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "20", "--log-interval", "10"]  # fmt: skip
    if not dry:
        base.append("--bf16")
    losses = {}
    seconds = {}
    for impl in ("portable", "megatron"):
        run = _pretrain([*base, "--ddp-impl", impl], os.path.join(workdir, f"engine_{impl}.jsonl"))
        if run["rc"] != 0:
            return dict(status="fail", engine=impl, rc=run["rc"], tail=run["tail"])
        losses[impl] = [r["loss"] for r in run["records"]]
        seconds[impl] = statistics.median(r["seconds"] for r in run["records"][5:])
    diff = max(abs(a - b) for a, b in zip(losses["portable"], losses["megatron"]))
    # BF16 runs of two engines reduce in different orders: agree to 2% of the first loss.
    tol = 0.02 * losses["portable"][0]
    return dict(
        status="pass" if diff <= tol else "fail",
        max_abs_loss_difference=diff,
        tolerance=tol,
        losses=losses,
        median_step_seconds=seconds,
        megatron_vs_portable_speed=seconds["portable"] / seconds["megatron"],
    )


def run_pytest(files: list[str], timeout: float) -> dict:
    """The GPU-side test files, from the source checkout (skipped for an installed package)."""
    if not (REPO / "tests").is_dir():
        return dict(status="skipped", reason="no tests/ beside the package (not a checkout)")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return dict(status="pass" if proc.returncode == 0 else "fail", summary=last, files=files)


# ----------------------------------------------------------------------------- throughput


def _model_config(arm: str, dry: bool, seq: int, vocab: int) -> ModelConfig:
    shape = dict(MODEL_SIZE_PRESETS["1.2b"]) if not dry else dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=176
    )  # fmt: skip
    lev = {} if not dry else dict(seed_dim=16, rank=8, num_heads=2)
    return ModelConfig(
        vocab_size=vocab, seq_length=seq, embedding=dict(embedding_type=arm, lev=lev), **shape
    )


def _start_micro_batch(cfg: ModelConfig, memory_gib: Optional[float], dry: bool) -> int:
    if dry or memory_gib is None:
        return 2
    best = 1
    for mbs in (1, 2, 4, 8, 16, 32):
        layout = TrainingPlan(micro_batch_size=mbs)  # BF16 (the plan's default)
        if estimate_memory(cfg, layout).total <= 0.9 * memory_gib * 2**30:
            best = mbs
    return best


def throughput(workdir: str, dry: bool, budget: Budget, iters: int, warmup: int) -> dict:
    """Median step time of the 1.2B LEV and TIED arms, BF16 then FP8, at the largest mbs."""
    seq = 64 if dry else 4096
    vocab = 512 if dry else PAPER_VOCAB
    memory = None
    peak = None
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        peak = peak_tflops()  # the training log's table (megatron_ext/training/metrics.py)
    shape_flags = (
        ["--model-size", "1.2b", "--no-use-cpu-initialization"]
        if not dry
        else _small_model_flags(True)[:6] + ["--ffn-hidden-size", "176", "--lev-seed-dim", "16",
                                             "--lev-rank", "8", "--lev-num-heads", "2"]
    )  # fmt: skip
    precisions = ["bf16"] if dry else ["bf16", "fp8"]
    out: dict = dict(seq_length=seq, vocab_size=vocab, peak_bf16_tflops=peak, runs={})
    mbs_cache: dict[str, int] = {}
    for precision in precisions:
        for arm in ("lev", "tied"):
            label = f"{arm}_{precision}"
            if budget.left() < (30 if dry else 75):
                out["runs"][label] = dict(status="skipped", reason="time budget")
                continue
            cfg = _model_config(arm, dry, seq, vocab)
            mbs = mbs_cache.get(precision) or _start_micro_batch(cfg, memory, dry)
            flags = [*shape_flags, "--seq-length", str(seq), "--vocab-size", str(vocab),
                     "--embedding-type", arm, "--train-iters", str(iters),
                     "--log-interval", str(iters), "--bf16"]  # fmt: skip
            if precision == "fp8":
                flags += ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"]
            while True:
                run = _pretrain(
                    [*flags, "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs)],
                    os.path.join(workdir, f"tp_{label}_{mbs}.jsonl"),
                    timeout=max(30.0, budget.left() - 10),
                )
                oom = any(m in run["tail"] for m in _OOM_MARKERS)
                if run["rc"] != 0 and oom and mbs > 1:
                    mbs //= 2
                    continue
                break
            if run["rc"] != 0 or len(run["records"]) <= warmup:
                out["runs"][label] = dict(status="fail", rc=run["rc"], tail=run["tail"])
                continue
            # LEV and TIED run at the same micro-batch (the one that fits the larger of them).
            mbs_cache[precision] = mbs
            step = statistics.median(r["seconds"] for r in run["records"][warmup:])
            tokens = mbs * seq / step
            tflops = flops_per_token(cfg) * tokens / 1e12
            out["runs"][label] = dict(
                status="pass",
                micro_batch_size=mbs,
                step_seconds=step,
                tokens_per_second=tokens,
                tflops_per_gpu=tflops,
                mfu=(tflops / peak) if peak else None,
            )
            _log(
                f"{label}: mbs {mbs}, {step:.3f} s/step, {tokens:,.0f} tok/s, {tflops:.1f} TFLOP/s"
            )
    _add_ratios(out, precisions)
    return out


def _add_ratios(out: dict, precisions: list[str]) -> None:
    """`throughput`'s ratios between the passed runs, its targets and its status."""
    runs = out["runs"]

    def ok(label):
        return runs.get(label, {}).get("status") == "pass"

    for precision in precisions:
        lev, tied = f"lev_{precision}", f"tied_{precision}"
        if ok(lev) and ok(tied):
            out[f"lev_over_tied_step_time_{precision}"] = (
                runs[lev]["step_seconds"] / runs[tied]["step_seconds"]
            )
    if ok("lev_fp8") and ok("lev_bf16"):
        out["fp8_over_bf16_speedup_lev"] = (
            runs["lev_fp8"]["tokens_per_second"] / runs["lev_bf16"]["tokens_per_second"]
        )
    out["targets"] = dict(
        bf16_mfu_lev=">= 0.45", lev_over_tied_step_time="<= 1.01", fp8_over_bf16=">= 1.3"
    )
    out["status"] = "pass" if all(r.get("status") == "pass" for r in runs.values()) else "fail"


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    """The command (tools/gpu_check.py, scripts/gpu_check.sh): checks, throughput, JSON."""
    return run_tool(_main, argv, log_format=None)


def build_parser() -> argparse.ArgumentParser:
    """The command line of the GPU check."""
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=450.0,
        help="seconds for all phases: a phase that would not fit is skipped and recorded so",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="throughput iterations (default: 12 on a GPU, 4 with --cpu-dry-run)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="iterations left out of timing (default: 4 on a GPU, 1 with --cpu-dry-run)",
    )
    return parser


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    dry = args.cpu_dry_run
    cuda = torch.cuda.is_available()
    if not dry and not cuda:
        print("gpu_check: error: no CUDA device; use --cpu-dry-run on CPU", file=sys.stderr)
        return 2
    iters = args.iters or (4 if dry else 12)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 4)
    budget = Budget(args.time_budget_s)
    out_path = Path(args.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = dict(mode="cpu-dry-run" if dry else "gpu", environment=environment())
    checks: dict = {}
    result["checks"] = checks
    te = cuda and result["environment"]["transformer_engine"] is not None
    no_te = dict(status="skipped", reason="needs CUDA and Transformer Engine")
    with tempfile.TemporaryDirectory() as workdir:
        _run_phase("triton_vs_torch", checks, budget, 20, lambda: check_triton(
            "cuda" if cuda else "cpu"))  # fmt: skip
        if te:
            _run_phase("te_vs_local_logits", checks, budget, 30, compare_te_and_local_logits)
            _run_phase("fp8_steps", checks, budget, 60, lambda: check_fp8(workdir, dry))
        else:
            checks["te_vs_local_logits"] = dict(no_te)
            checks["fp8_steps"] = dict(no_te)
        if cuda:
            _run_phase("engines_20_steps", checks, budget, 90, lambda: check_engines(workdir, dry))
            files = [
                "tests/lev/test_lev_reference.py",  # every kernel, Triton on CUDA, vs float64
                "tests/lev/test_lev_triton.py",
                "tests/models/test_te_mapping.py",
            ]
            _run_phase("gpu_pytest", checks, budget, 60, lambda: run_pytest(files, 120))
        else:
            reason = "needs CUDA (the megatron engine and the GPU pytest run are CUDA only)"
            checks["engines_20_steps"] = dict(status="skipped", reason=reason)
            checks["gpu_pytest"] = dict(status="skipped", reason=reason)
        _write_json(out_path, result)  # checks are kept even if throughput is cut short
        run = functools.partial(throughput, workdir, dry, budget, iters, warmup)
        _run_phase("throughput", result, budget, 30, run)
    failed = [k for k, v in checks.items() if v.get("status") == "fail"]
    if result["throughput"].get("status") == "fail":
        failed.append("throughput")
    result["status"] = "fail" if failed else "pass"
    result["failed"] = failed
    _write_json(out_path, result)
    _log(f"wrote {out_path}: {result['status']}{' ' + ', '.join(failed) if failed else ''}")
    tp = result["throughput"]
    for label, run in tp.get("runs", {}).items():
        if run.get("status") == "pass":
            mfu = f"{run['mfu']:.1%}" if run.get("mfu") is not None else "n/a"
            print(
                f"{label:10s} mbs {run['micro_batch_size']:3d}  {run['tokens_per_second']:12,.0f}"
                f" tok/s  {run['tflops_per_gpu']:8.1f} TFLOP/s  MFU {mfu}"
            )
    for key in ("lev_over_tied_step_time_bf16", "lev_over_tied_step_time_fp8"):
        if key in tp:
            print(f"{key}: {tp[key]:.4f}")
    if "fp8_over_bf16_speedup_lev" in tp:
        print(f"fp8_over_bf16_speedup_lev: {tp['fp8_over_bf16_speedup_lev']:.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
