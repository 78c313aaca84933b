"""Two torchrun agents (--nnodes 2, c10d rendezvous on loopback) with 2 processes each and TP=2
(real processes, gloo): TP stays within an agent's processes, DP runs across, the losses equal
one 4-process agent's (forked ranks: tests.support.runs.train), also when a rank of the second
agent is killed and both agents restart their ranks. (Split from test_cluster.py so that
pytest-xdist, --dist loadfile, can run the two longest cluster checks on different workers.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.cluster import cluster_job as _job
from tests.support.cluster import records as _records
from tests.support.cluster import torchrun_cmd as _torchrun
from tests.support.distributed import find_free_port
from tests.support.runs import TINY_LEV_MODEL, TINY_TRAIN, train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def train_args(corpus) -> list[str]:
    """The flags of test_cluster.py's runs; each run here sets its own iterations and saves."""
    return [*TINY_LEV_MODEL, *TINY_TRAIN, *corpus, "--eval-iters", "0"]


MULTI_NODE_ITERS = 10
MULTI_NODE_SAVE_INTERVAL = 2


def _tp2_run(train_args, ckpt: Path, save_interval: int = MULTI_NODE_SAVE_INTERVAL) -> list[str]:
    return [*train_args, "--tensor-model-parallel-size", "2", "--exit-interval",
            str(MULTI_NODE_ITERS), "--save-interval", str(save_interval),
            "--save", str(ckpt), "--load", str(ckpt)]  # fmt: skip


def _placement(output: str) -> dict[str, list[tuple[int, int, int]]]:
    """{node: [(rank, tp, dp), ...]} from rank 0's `placement:` lines (the last round's)."""
    nodes = {}
    for node, ranks in re.findall(r"placement: (node \d+): (.*)", output):
        found = re.findall(r"rank (\d+) \(local \d+: tp (\d+) dp (\d+) pp 0\)", ranks)
        nodes[node] = [tuple(map(int, r)) for r in found]
    return nodes


def test_two_nodes_tp_within_dp_across_equal_one_node(train_args, tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on loopback), 2 processes each, TP=2:
    each agent's processes form one TP group, DP runs across the agents, and the losses equal
    those of one agent with 4 processes. Under --max-restarts a rank of the second agent is
    killed mid-run: both agents restart their ranks (their own restart counters may differ; the
    log counts the job's restarts), which resume from the latest checkpoint and still train the
    same losses."""
    single = tmp_path / "single"  # uninterrupted: it saves only its last iteration
    run = train(4, _tp2_run(train_args, single / "ckpt", MULTI_NODE_ITERS), single)
    expected = run.check().losses
    assert sorted(expected) == list(range(1, MULTI_NODE_ITERS + 1))

    multi = tmp_path / "multi"
    endpoint = f"127.0.0.1:{find_free_port()}"
    jsonl, ckpt = multi / "metrics.jsonl", multi / "ckpt"
    agents = []
    for node in (0, 1):
        cmd = _torchrun(_tp2_run(train_args, ckpt), jsonl, "--nnodes", "2", "--node-rank",
                        str(node), "--max-restarts", "2", endpoint=endpoint)  # fmt: skip
        agents.append(_job(cmd, multi / f"agent{node}"))
    with agents[0], agents[1]:
        launched = [{}, {}]  # {rank: pid} each agent started
        deadline = time.monotonic() + 240
        while not all(len(r) == 2 for r in launched):
            assert all(a.proc.poll() is None for a in agents), agents[0].output()[-4000:]
            assert time.monotonic() < deadline, launched
            for seen, agent in zip(launched, agents):
                seen.update(agent.ranks())
            time.sleep(0.05)
        agents[0].wait_for_lines(jsonl, MULTI_NODE_SAVE_INTERVAL + 1)
        pids = [pid for seen in launched for pid in seen.values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
        victim = min(launched[1].values())
        os.kill(victim, signal.SIGKILL)
        for pid in pids:
            if pid != victim:
                os.kill(pid, signal.SIGCONT)
        returncodes = [a.wait() for a in agents]
    output = "".join(a.output() for a in agents)
    assert returncodes == [0, 0], output[-4000:]
    assert sorted(sorted(r) for r in launched) == [[0, 1], [2, 3]], launched
    assert (
        "torchrun restarted the ranks (restart 1 of --max-restarts 2) after a rank failed: "
        f"resuming from iteration {saved}"
    ) in output, output[-4000:]

    nodes = _placement(output)
    # torchrun's node index (GROUP_RANK) of each rank, as the ranks report it: one node per
    # agent, TP ranks 0 and 1 on the same node, the DP replicas on different nodes.
    assert sorted(nodes.values()) == [[(0, 0, 0), (1, 1, 0)], [(2, 0, 1), (3, 1, 1)]], nodes
    assert "span nodes" not in output

    losses = {r["iteration"]: r["loss"] for r in _records(jsonl)}
    assert losses == expected
    for run in (single / "ckpt", ckpt):
        assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == str(
            MULTI_NODE_ITERS
        )
    saved_files = [sorted(p.name for p in (c / f"iter_{MULTI_NODE_ITERS:07d}").iterdir())
                   for c in (single / "ckpt", ckpt)]  # fmt: skip
    assert saved_files[0] == saved_files[1] and "common.json" in saved_files[0]
