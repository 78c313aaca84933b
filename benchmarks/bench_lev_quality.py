"""LEV training quality at small scale: validation-loss gap of LEVIATHAN (and, with --all-arms,
every arm) to TIED over several seeds, in this stack and in a plain-PyTorch loop.

Each run is `pretrain_leviathan.py` on one CPU process (or, with --plain, `plain_gpt.py`); a
variant ("NAME=FLAGS") reruns the LEV arm with extra flags. Prints each group's final validation
loss and gap to TIED of the same seed; writes `results.json` and `curves.png` into --out-dir. A
finished run is not rerun.

    python benchmarks/bench_lev_quality.py --data-path data/kjv8k_text_document \\
        --tokenizer-model data/kjv8k.model --seeds 0 1 2 --plain --out-dir runs/lev-quality
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks.harness` when this file runs as a script

from benchmarks.harness import LEV_FLAGS, STUDY_FLAGS, add_defaults, add_study_flags  # noqa: E402
from megatron_ext._paths import atomic_open, atomic_write  # noqa: E402

ALL_ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")
_VAL = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")


def _setting_flags(args, names: tuple[str, ...] = ()) -> list[str]:
    """`--name value` of the study's settings (STUDY_FLAGS, `names`, LEV_FLAGS) in `args`."""
    cmd = []
    for name in (*STUDY_FLAGS, *names, *LEV_FLAGS):
        cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return cmd


def stack_command(arm: str, seed: int, extra: list[str], args) -> list[str]:
    """pretrain_leviathan.py for one arm and seed with the study's settings."""
    cmd = [sys.executable, str(REPO / "pretrain_leviathan.py"), "--embedding-type", arm]
    cmd += _setting_flags(args)
    cmd += [
        "--micro-batch-size", str(args.global_batch_size), "--lr-decay-style", "cosine",
        "--seed", str(seed), "--data-path", args.data_path, "--split", args.split,
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", args.tokenizer_model,
        "--eval-iters", str(args.eval_samples // args.global_batch_size),
        "--log-interval", str(args.log_interval), "--num-workers", "0", "--no-loss-curve",
    ]  # fmt: skip
    return cmd + shlex.split(args.extra) + extra


def plain_command(arm: str, seed: int, extra: list[str], args) -> list[str]:
    """benchmarks.plain_gpt for one arm and seed with the study's settings."""
    from megatron_ext.config.data import padded_vocab_size
    from megatron_ext.data.tokenizers import build_tokenizer

    cmd = [sys.executable, "-m", "benchmarks.plain_gpt", "--embedding", arm]
    cmd += _setting_flags(args, ("eval_samples", "log_interval", "split", "data_path"))
    # The stack's padded vocabulary (so LEV's digit base is the same in both).
    vocab = padded_vocab_size(
        build_tokenizer("SentencePieceTokenizer", args.tokenizer_model).vocab_size
    )
    return cmd + ["--seed", str(seed), "--vocab-size", str(vocab)] + args.plain_extra + extra


def read_curve(log: Path) -> dict[int, float]:
    """Iteration -> validation loss from a finished run's log."""
    text = log.read_text(errors="replace")
    return {int(it): float(loss) for it, loss in _VAL.findall(text)}


def finished(log: Path) -> bool:
    """Whether `log` is the log of a run that completed."""
    return log.is_file() and "done (finished)" in log.read_text(errors="replace")


def run(name: str, cmd: list[str], out_dir: Path, env: dict) -> dict[int, float]:
    """Run `cmd` (unless its log says it finished) and return its validation curve."""
    log = out_dir / f"{name}.log"
    if not finished(log):
        start = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {shlex.join(cmd[1:])}", flush=True)
        tmp = log.with_suffix(".log.tmp")
        with open(tmp, "w") as handle:
            handle.write(shlex.join(cmd) + "\n")
            handle.flush()
            proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
        if proc.returncode != 0:
            sys.exit(f"bench_lev_quality: {name} failed (exit {proc.returncode}); see {tmp}")
        os.replace(tmp, log)
        print(f"    {name}: {time.time() - start:.0f} s", flush=True)
    curve = read_curve(log)
    if not curve:
        sys.exit(f"bench_lev_quality: no validation loss in {log}")
    return curve


def summarise(curves: dict[str, dict[int, dict[int, float]]]) -> list[dict]:
    """Per run group: final loss mean/std over its seeds, and the gap to the TIED group of its
    implementation over the seeds both have."""
    rows = []
    for group, by_seed in curves.items():
        impl = group.split("/")[0]
        base = curves.get(f"{impl}/tied", {})
        seeds = sorted(by_seed)
        finals = [by_seed[s][max(by_seed[s])] for s in seeds]
        gaps, at = {}, {}
        for s in seeds:
            if s in base:  # at the last evaluation both runs reached (the end, once finished)
                it = at[s] = max(set(by_seed[s]) & set(base[s]))
                gaps[s] = by_seed[s][it] - base[s][it]
        rows.append(
            dict(
                group=group,
                seeds=seeds,
                final=statistics.mean(finals),
                final_std=statistics.stdev(finals) if len(finals) > 1 else 0.0,
                gaps=gaps,
                gap_iterations=at,
                last_iteration=min(max(by_seed[s]) for s in seeds),
                gap=statistics.mean(gaps.values()) if gaps else None,
                gap_std=statistics.stdev(gaps.values()) if len(gaps) > 1 else 0.0,
            )
        )
    return rows


def plot(curves, path: Path) -> None:
    """Mean validation curve per group over its seeds (shaded: min..max), and the gap to TIED
    of the same implementation per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(13, 5))
    for group, by_seed in curves.items():
        seeds = sorted(by_seed)
        its = sorted(set.intersection(*(set(by_seed[s]) for s in seeds)))
        vals = [[by_seed[s][i] for s in seeds] for i in its]
        style = "--" if group.startswith("plain/") else "-"
        label = f"{group} (n={len(seeds)})"
        (line,) = ax.plot(its, [statistics.mean(v) for v in vals], style, label=label)
        ax.fill_between(its, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15,
                        color=line.get_color())  # fmt: skip
        base = curves.get(group.split("/")[0] + "/tied")
        if base is None or group.endswith("/tied"):
            continue
        both = [s for s in seeds if s in base]
        gap_its = [i for i in its if all(i in base[s] for s in both)]
        if both and gap_its:
            gaps = [statistics.mean(by_seed[s][i] - base[s][i] for s in both) for i in gap_its]
            gx.plot(gap_its, gaps, style, color=line.get_color(), label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("validation loss (mean over seeds; band: min..max)")
    lows = [min(min(c.values()) for c in g.values()) for g in curves.values()]
    ax.set_ylim(min(lows) - 0.1, min(lows) + 1.5)
    gx.axhline(0.0, color="black", linewidth=0.8)
    gx.set_xlabel("iteration")
    gx.set_ylabel("validation loss - TIED's (same seed, same implementation)")
    gx.set_title("gap to TIED (mean over seeds)")
    for a in (ax, gx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-path", required=True, help="indexed dataset prefix (.bin/.idx)")
    p.add_argument("--tokenizer-model", required=True, help="SentencePiece .model of the data")
    add_defaults(p, split="95,5,0", out_dir="runs/lev-quality")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--all-arms", action="store_true", help="all six arms, not TIED and LEV")
    p.add_argument(
        "--plain", action="store_true", help="also run the plain-PyTorch baseline (TIED, LEV)"
    )
    p.add_argument("--no-stack", action="store_true", help="skip the pretrain_leviathan.py runs")
    p.add_argument(
        "--include-running",
        action="store_true",
        help="with --no-run: also summarise runs still in progress (their .log.tmp); gaps are "
        "then taken at the last evaluation both runs of a pair reached",
    )
    p.add_argument(
        "--no-run",
        action="store_true",
        help="only summarise the finished runs in --out-dir (groups over the seeds they have)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="rerun the LEV arm with these extra flags (repeatable)",
    )
    p.add_argument("--extra", default="", help="more pretrain_leviathan.py flags for every run")
    p.add_argument("--plain-extra", type=shlex.split, default=[], help="more plain-baseline flags")
    add_study_flags(p)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    args = p.parse_args()
    if args.eval_samples < args.global_batch_size:
        sys.exit("bench_lev_quality: --eval-samples must be >= --global-batch-size")
    return args


def print_summary(rows: list[dict], curves: dict, args: argparse.Namespace) -> None:
    """The table of final losses and gaps to TIED, and the stack / plain gap comparisons."""
    print(f"\nfinal validation loss after {args.train_iters} iterations (mean ± std over seeds)")
    print(f"{'run group':30s} {'seeds':>7s} {'val loss':>15s} {'gap to TIED':>15s}  gap per seed")
    for row in rows:
        gap = "" if row["gap"] is None else f"{row['gap']:+.3f} ± {row['gap_std']:.3f}"
        per_seed = " ".join(
            f"{g:+.3f}" + ("" if row["gap_iterations"][s] == args.train_iters else
                           f" (at {row['gap_iterations'][s]})")
            for s, g in row["gaps"].items()
        )  # fmt: skip
        if row["last_iteration"] < args.train_iters:
            per_seed += f"  [running: {row['last_iteration']} iterations so far]"
        seeds = ",".join(map(str, row["seeds"]))
        print(f"{row['group']:30s} {seeds:>7s} {row['final']:7.3f} ± {row['final_std']:.3f} "
              f"{gap:>15s}  {per_seed}")  # fmt: skip
    gaps = {r["group"]: r for r in rows if r["gap"] is not None}
    done = {g for g, r in gaps.items() if r["last_iteration"] >= args.train_iters}
    if {"stack/lev", "plain/lev"} <= done:
        diff = gaps["stack/lev"]["gap"] - gaps["plain/lev"]["gap"]
        print(f"stack gap - plain gap: {diff:+.3f}")
    pair_groups = ("stack/lev", "stack/tied", "plain/lev", "plain/tied")
    if all(g in curves for g in pair_groups):  # like for like, also while runs are in progress
        for seed in sorted(set.intersection(*(set(curves[g]) for g in pair_groups))):
            it = max(set.intersection(*(set(curves[g][seed]) for g in pair_groups)))
            gap = {i: curves[f"{i}/lev"][seed][it] - curves[f"{i}/tied"][seed][it]
                   for i in ("stack", "plain")}  # fmt: skip
            print(f"seed {seed}, iteration {it} (the last all four runs reached): "
                  f"stack gap {gap['stack']:+.3f}, plain gap {gap['plain']:+.3f}")  # fmt: skip


def main() -> None:
    args = parse_args()
    variants = {}
    for item in args.variant:
        name, sep, flags = item.partition("=")
        if not sep or not name or "/" in name:
            sys.exit(f"bench_lev_quality: --variant wants NAME=FLAGS, got {item!r}")
        variants[name] = shlex.split(flags)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    arms = list(ALL_ARMS) if args.all_arms else ["tied", "lev"]
    plan = []  # (group, command builder, arm, extra flags), in the order run per seed
    if not args.no_stack:
        plan += [(f"stack/{arm}", stack_command, arm, []) for arm in arms]
    if args.plain:
        plan += [(f"plain/{arm}", plain_command, arm, []) for arm in ("tied", "lev")]
    if not args.no_stack:
        plan += [(f"stack/lev+{n}", stack_command, "lev", f) for n, f in variants.items()]
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for seed in args.seeds:  # seed-major: a partial study already has every group's first seeds
        for group, build, arm, extra in plan:
            name = f"{group.replace('/', '-')}-s{seed}"
            log = out_dir / f"{name}.log"
            if args.no_run and not finished(log):
                running = log.with_suffix(".log.tmp")
                if args.include_running and running.is_file() and read_curve(running):
                    curves.setdefault(group, {})[seed] = read_curve(running)
                continue
            cmd = build(arm, seed, extra, args)
            curves.setdefault(group, {})[seed] = run(name, cmd, out_dir, env)
    if not curves:
        sys.exit(f"bench_lev_quality: no finished run in {out_dir}")

    rows = summarise(curves)
    print_summary(rows, curves, args)
    result = dict(settings=vars(args), rows=rows, curves=curves)
    atomic_write(out_dir / "results.json", json.dumps(result, indent=1))
    plot(curves, out_dir / "curves.png")
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'curves.png'}")


if __name__ == "__main__":
    main()
