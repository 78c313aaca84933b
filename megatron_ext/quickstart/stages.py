"""A resumable stage runner: each stage writes into a temporary directory that is renamed into
place only when complete, and a finished stage whose settings did not change is reused.

Every stage writes into ``OUT/.<stage>.tmp``, puts a completion marker (:data:`MARKER`) there and
renames it to ``OUT/<stage>``; an interrupted or failed stage leaves nothing behind and is redone
by the next run. Once one stage is redone, every later stage is redone too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_ext._paths import display_path
from megatron_ext.launch import launch

__all__ = [
    "MARKER",
    "Stage",
    "StageError",
    "compact_iteration_line",
    "run_command",
    "run_launched",
    "run_stages",
    "say",
    "short_path",
]

MARKER = ".complete.json"


class StageError(RuntimeError):
    """A stage's command failed; the message says which and where its log is."""


@dataclass
class Stage:
    """One step of a pipeline: ``run(tmp)`` writes everything into ``tmp`` and returns a
    one-line summary; ``key`` holds the settings that decide its outputs; ``needs``: the
    earlier stages it reads (None: all of them), those a part of the pipeline run alone
    (``run_stages(only=...)``) must find finished."""

    name: str
    title: str
    key: dict
    run: Callable[[Path], str]
    needs: Optional[tuple[str, ...]] = None


def say(msg: str = "") -> None:
    """Print a progress line at once (the stages' output is interleaved with children's)."""
    print(msg, flush=True)


def short_path(arg: str) -> str:
    """An argument as shown: a path (or the PATH of ``NAME=PATH``) relative to the current
    directory when it lies below it (``.venv/bin/python`` for the project's interpreter)."""
    name, sep, path = arg.partition("=")
    if sep and os.path.isabs(path) and not os.path.isabs(arg):
        return f"{name}={display_path(path)}"
    return display_path(arg)


def compact_iteration_line(line: str) -> str:
    """Keep the informative fields of a Megatron iteration line."""
    if "|" not in line or "validation loss" in line or "iteration" not in line:
        return line.strip().rstrip(" |")
    keep = ("iteration ", "elapsed time per iteration", "tokens per second", "ETA", "lm loss")
    fields = [f.strip() for f in line.split("|") if f.strip().startswith(keep) or "]  iter" in f]
    return " | ".join(fields)


def run_command(
    cmd: list[str],
    *,
    cwd: Path,
    log: Optional[Path] = None,
    show: Optional[re.Pattern] = None,
) -> None:
    """Run ``cmd`` in ``cwd`` (first on PYTHONPATH; OMP_NUM_THREADS=1 unless set), its output
    to ``log`` with the lines matching ``show`` echoed, or to the terminal. A non-zero exit raises
    StageError with the log's end; Ctrl-C interrupts the child, then re-raises."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    say("  $ " + " ".join(short_path(c) for c in cmd))
    piped = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if log else {}
    with open(log, "w") if log else contextlib.nullcontext() as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, **piped)
        try:
            for line in proc.stdout or ():
                fh.write(line)
                _echo(line, show)
            rc = proc.wait()
        except KeyboardInterrupt:
            _stop(proc)
            raise
    if rc and log is None:
        raise StageError(f"command failed with exit code {rc}: {cmd[0]} ...")
    _check_exit(rc, log)


def run_launched(
    entry: str,
    nproc: int,
    args: list[str],
    *,
    python: str,
    cwd: Path,
    log: Path,
    show: Optional[re.Pattern] = None,
) -> None:
    """Run ``entry`` on ``nproc`` ranks under torchrun (megatron_ext.launch), output to
    ``log`` with the lines matching ``show`` echoed, as :func:`run_command` does for a plain
    command. Ctrl-C interrupts the ranks (torchrun forwards it), then re-raises."""
    job = launch(
        entry, nproc, args, python=python, cwd=cwd, log=log, timeout=None, torchrun=True,
        torchrun_args=("--standalone",),
    )  # fmt: skip
    say("  $ " + " ".join(short_path(c) for c in job.cmd))
    with job:
        try:
            rc = job.wait(on_line=lambda line: _echo(line, show))
        except KeyboardInterrupt:
            job.stop(grace=15)
            raise
    _check_exit(rc, log)


def _echo(line: str, show: Optional[re.Pattern]) -> None:
    if show is not None and show.search(line):
        say("    " + compact_iteration_line(line.rstrip()))


def _check_exit(rc: int, log: Path) -> None:
    if rc:
        tail = "".join(open(log).readlines()[-25:])
        raise StageError(f"command failed with exit code {rc}; end of {log}:\n{tail}")


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


def _fingerprint(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _finished(final: Path, fingerprint: str) -> Optional[dict]:
    """The completion marker of the stage in `final` if it was finished with these settings."""
    marker = final / MARKER
    done = json.loads(marker.read_text()) if marker.is_file() else {}
    return done if done.get("fingerprint") == fingerprint else None


def run_stages(stages: list[Stage], out: Path, only: Optional[Sequence[str]] = None) -> None:
    """Run the stages in order into ``out``, reusing each finished one whose ``key`` did not
    change (once one is redone, so are the later ones). ``only``: just these stages, whose
    ``needs`` must be finished. Ctrl-C discards the running stage and exits 130."""
    out.mkdir(parents=True, exist_ok=True)
    redo = False
    names = [stage.name for stage in stages]
    needed = set()
    for i, stage in enumerate(stages):
        if only is not None and stage.name in only:
            needed.update(names[:i] if stage.needs is None else stage.needs)
    for i, stage in enumerate(stages, 1):
        final, tmp = out / stage.name, out / f".{stage.name}.tmp"
        fp = _fingerprint(stage.key)
        header = f"[{i}/{len(stages)}] {stage.title}"
        if only is not None and stage.name not in only:
            if stage.name in needed and _finished(final, fp) is None:
                raise StageError(
                    f"stage '{stage.name}' is not finished for these settings in "
                    f"{short_path(str(final))}: run it first (--stages {stage.name})"
                )
            continue
        done = None if redo else _finished(final, fp)
        if done is not None:
            say(
                f"\n{header}: reusing the finished stage in {short_path(str(final))} "
                f"({done.get('summary', '')})"
            )
            continue
        redo = True
        say(f"\n{header} -> {short_path(str(final))}")
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
