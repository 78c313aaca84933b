"""Torchrun jobs for the cluster-resilience tests (tests/training/test_cluster*.py): the
command line of one torchrun agent, a `Job` that runs it in its own session, and the metrics
records a run wrote so far."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from megatron_ext.launch import job_environment
from tests.support.distributed import find_free_port
from tests.support.jobs import Job
from tests.support.runs import ENTRY, REPO

__all__ = ["TORCHRUN", "cluster_job", "records", "torchrun_cmd"]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def records(jsonl: Path) -> list[dict]:
    """The complete --log-jsonl records written so far (a line being written is skipped)."""
    if not jsonl.exists():
        return []
    lines = jsonl.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def cluster_job(cmd: list[str], workdir: Path, env: Optional[dict] = None) -> Job:
    """`cmd` (torchrun, or a batch script that starts it) in its own session, run from the
    repository, logging to workdir/output.log; everything it started is killed when the `with`
    block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    return Job(
        cmd, log_path=workdir / "output.log", env=job_environment(env), cwd=REPO,
        torchrun=True, signal_targets="ranks", timeout=480,
    )  # fmt: skip


def torchrun_cmd(
    args: list[str], jsonl: Path, *extra: str, nproc: int = 2, endpoint: Optional[str] = None
) -> list[str]:
    """torchrun (c10d rendezvous at `endpoint`, a free loopback port by default) running
    pretrain_leviathan with `args` and --log-jsonl `jsonl`; `extra` are torchrun's flags."""
    endpoint = endpoint or f"127.0.0.1:{find_free_port()}"
    return [
        *TORCHRUN, "--nproc-per-node", str(nproc), *extra,
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        str(ENTRY), *args, "--log-jsonl", str(jsonl),
    ]  # fmt: skip
