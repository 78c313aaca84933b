"""megatron_ext.parallel: a process started without torchrun is a one-rank world."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron_ext.testing.runs import REPO

_ONE_RANK = textwrap.dedent(
    """
    import os, sys, time
    from megatron_ext.parallel import initialize_parallel
    initialize_parallel()
    import torch.distributed as dist
    print(dist.get_world_size(), os.environ["MASTER_PORT"], flush=True)
    sys.stdin.readline()  # hold the group (and its port) until the test says go
    """
)


def test_plain_processes_get_their_own_port():
    """Two `python pretrain_leviathan.py` runs side by side must not fight over port 29500."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ONE_RANK],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    lines = [p.stdout.readline().split() for p in procs]  # both hold their groups now
    outs = [p.communicate("\n", timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert [line[0] for line in lines] == ["1", "1"]
    assert lines[0][1] != lines[1][1] and "29500" not in (lines[0][1], lines[1][1])
