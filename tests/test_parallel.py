"""megatron_ext.parallel.

- `ProcessGroups` (the groups passed to the loop, optimizer, schedule and checkpointing) agrees
  with megatron's `parallel_state` on a TP=2 x PP=2 layout of 4 gloo ranks (which
  `run_distributed` sets up: this is also its four-rank test), a collective on its TP group
  reaches exactly that group, and
  `initialize_parallel` seeds like Megatron-LM (offset by the pipeline rank);
- `ProcessGroups.current()` finds the same groups, `megatron_collection()` hands exactly
  them to megatron-core; without initialised groups `current()` is None;
- a process started without torchrun is a one-rank world that needs no port and leaves
  os.environ as it was;
- a collective timeout is recognised behind the errors raised from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.runs import REPO

pytestmark = pytest.mark.integration


def _check_groups() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_ext.parallel import ProcessGroups, set_random_seed
    from megatron_ext.rng import device_rng

    pg = ProcessGroups.from_megatron()
    assert (pg.tp_rank, pg.tp_size) == (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )
    assert (pg.pp_rank, pg.pp_size) == (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
    )
    assert (pg.dp_rank, pg.dp_size) == (
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
    )
    assert pg.dp_cp_size == ps.get_data_parallel_world_size(with_context_parallel=True)
    assert (pg.cp_rank, pg.cp_size) == (0, 1)
    assert pg.is_first_stage == ps.is_pipeline_first_stage()
    assert pg.is_last_stage == ps.is_pipeline_last_stage()
    assert pg.pp_neighbour(-1) == ps.get_pipeline_model_parallel_prev_rank()
    assert pg.pp_neighbour(1) == ps.get_pipeline_model_parallel_next_rank()
    assert dist.get_process_group_ranks(pg.mp) == dist.get_process_group_ranks(
        ps.get_model_parallel_group()
    )
    assert ProcessGroups.current() == pg
    collection = pg.megatron_collection()  # what build_model(pg=...) hands to GPTModel
    for name in ("tp", "pp", "cp", "dp", "dp_cp", "mp", "embd"):
        assert getattr(collection, name) is getattr(pg, name), name
    # ... and what a training model_provider gets back from its pg_collection.
    assert ProcessGroups.from_collection(collection) == pg
    # A collective on the passed group reaches exactly that group's ranks: TP pairs (0, 1) and
    # (2, 3) sum rank + 1 to 3 and 7.
    tp_sum = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tp_sum, group=pg.tp)
    set_random_seed(7, pg.pp_rank)
    draw = torch.rand(1).item()
    torch.manual_seed(7 + 100 * pg.pp_rank)
    assert draw == torch.rand(1).item()
    # Dropout's CPU streams: inside a TP region (a fork) and outside it (the device stream).
    with get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(2).tolist()
    with device_rng():
        device = torch.rand(2).tolist()
    return dict(
        rank=dist.get_rank(),
        coords=pg.coords(),
        layout=pg.layout(),
        tp_sum=tp_sum.item(),
        dropout=(model_parallel, device),
        embd=None if pg.embd is None else dist.get_process_group_ranks(pg.embd),
    )


def test_process_groups_match_megatron():
    results = run_distributed(_check_groups, world_size=4, tp=2, pp=2)
    assert all(r["layout"] == dict(tp=2, pp=2, cp=1, dp=1) for r in results)
    # Megatron's rank order: TP fastest, then PP (DP=1 here).
    assert [(r["coords"]["tp"], r["coords"]["pp"]) for r in results] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    assert [r["coords"]["dp"] for r in results] == [0, 0, 0, 0]
    assert [r["tp_sum"] for r in results] == [3.0, 3.0, 7.0, 7.0]
    # As megatron seeds them: dropout inside TP regions differs between the TP ranks of a
    # stage, outside them it is the same; each stage has its own (the pipeline offset).
    (mp00, dev00), (mp10, dev10), (mp01, dev01), (mp11, dev11) = [r["dropout"] for r in results]
    assert mp00 != mp10 and mp01 != mp11 and mp00 != mp01
    assert dev00 == dev10 and dev01 == dev11 and dev00 != dev01
    # Every rank is on the first or the last stage, so each holds a tied-embedding copy; the
    # embedding group pairs the same TP rank of the two stages.
    assert [r["embd"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


TORCHRUN_IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# argv[1:]: TORCHRUN_IDENTITY.
_ONE_RANK = textwrap.dedent(
    """
    import os, subprocess, sys
    import torch, torch.distributed as dist
    from megatron_ext.parallel import ProcessGroups, destroy_parallel, initialize_parallel
    IDENTITY = tuple(sys.argv[1:])
    before = dict(os.environ)
    assert ProcessGroups.current() is None
    for _ in range(2):  # a tool's main called twice in one notebook
        groups = initialize_parallel()
        total = torch.ones(3)
        dist.all_reduce(total, group=groups.tp)
        assert total.tolist() == [1.0, 1.0, 1.0]
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(k for k in %r if k in os.environ))"
             % (IDENTITY,)], capture_output=True, text=True, check=True)
        print(dist.get_world_size(), child.stdout.strip(), flush=True)
        destroy_parallel()
        dist.destroy_process_group()
    sys.stdin.readline()  # both processes have run before either exits
    """
)


def test_plain_processes_are_one_rank_worlds_that_leave_the_environment_alone():
    """Two `python pretrain_leviathan.py` runs side by side (no torchrun) each set up a one-rank
    world, twice in a row, without a port to fight over and without writing a torchrun
    identity into os.environ that processes they start would inherit."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_IDENTITY}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ONE_RANK, *TORCHRUN_IDENTITY],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    lines = [[p.stdout.readline().strip() for _ in range(2)] for p in procs]
    outs = [p.communicate("\n", timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert lines == [["1 []", "1 []"]] * 2


def test_a_collective_timeout_is_found_behind_the_error_raised_from_it():
    """torch's pipeline stages raise their own RuntimeError from what their backward raised:
    a gloo timeout there is still a collective timeout (the loop names the group and the last
    checkpoint instead of printing a traceback; tests/training/test_cluster.py)."""
    from megatron_ext.parallel import is_collective_timeout

    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms")
    try:
        try:
            raise gloo
        except RuntimeError as error:
            raise RuntimeError("Failed to run stage backward: ...") from error
    except RuntimeError as wrapped:
        assert is_collective_timeout(wrapped)
    assert not is_collective_timeout(RuntimeError("Failed to run stage backward: ..."))
    assert not is_collective_timeout(ValueError("timed out"))
    assert not is_collective_timeout(None)
