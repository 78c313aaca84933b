import os

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_distributed, run_entry

pytestmark = pytest.mark.integration


def _layout_and_allreduce():
    from megatron.core import parallel_state as ps

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
        t.item(),
    )


def _raise():
    raise ValueError("boom from a rank")


# The four-rank TP=2 x PP=2 layout (ranks, groups, a TP all-reduce) is checked by
# tests/test_parallel.py::test_process_groups_match_megatron, which runs through this harness.


def test_rank_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom from a rank"):
        run_distributed(_raise, world_size=2, tp=2)


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        run_distributed(_layout_and_allreduce, world_size=3, tp=2)


PROBE = """
import os, sys, time
def cli_main(argv):
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank} of {os.environ.get('WORLD_SIZE')} in {os.getcwd()} argv {argv}")
    print(f"rank {rank} threads {os.environ['OMP_NUM_THREADS']} {os.environ['PROBE']}",
          file=sys.stderr)
    if rank == 1:
        return 3
    if "--quit" in argv:
        return 0
    time.sleep(600)  # a peer blocked in a collective

if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
"""


def test_run_entry_gives_ranks_torchruns_environment_and_stops_a_failed_job(tmp_path, monkeypatch):
    """A forked job's ranks see torchrun's rank variables, the working directory and their
    arguments (`python -m MODULE` / `python SCRIPT`); stdout and stderr go to their files; the
    first failing rank's status is the job's, and a peer left waiting is stopped."""
    (tmp_path / "probe_entry.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    work, out, err = tmp_path / "work", tmp_path / "out.log", tmp_path / "err.log"
    work.mkdir()
    code = run_entry("probe_entry", 2, ["--x", 1], cwd=work, log_path=out, stderr_path=err,
                     env={"PROBE": "seen"}, timeout=60)  # fmt: skip
    assert code == 3
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # the job's: the caller's, else 1
    assert sorted(out.read_text().splitlines()) == [
        f"rank {r} of 2 in {work} argv ['--x', '1']" for r in (0, 1)
    ]
    assert sorted(err.read_text().splitlines()) == [
        f"rank {r} threads {threads} seen" for r in (0, 1)
    ]
    # A script path runs as `python SCRIPT`; one process has no rank variables.
    script = str(tmp_path / "probe_entry.py")
    assert run_entry(script, 1, ["--quit"], cwd=work, log_path=out, env={"PROBE": "1"}) == 0
    assert out.read_text().splitlines()[-2:] == [
        f"rank 0 of None in {work} argv ['--quit']",
        f"rank 0 threads {threads} 1",
    ]
