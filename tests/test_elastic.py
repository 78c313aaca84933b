"""megatron_ext.elastic.round_store against a real TCPStore holding a previous round's keys, as
torchrun's agent store does after a restart (the restart itself runs in
tests/training/test_cluster.py)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron_ext.elastic import restart_round, round_store
from megatron_ext.launch import find_free_port

TIMEOUT = datetime.timedelta(seconds=60)


@pytest.fixture
def agent_store(monkeypatch):
    """The agent's store (the server) and the env a torchrun worker gets for it."""
    port = find_free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return server


def _round(world_size: int, order: list[int]) -> dict[int, tuple]:
    """Start the ranks in `order` (a little apart) in threads; {rank: round_store result}."""
    results, errors = {}, []

    def run(rank):
        try:
            results[rank] = round_store(rank, world_size, TIMEOUT)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    threads = []
    for rank in order:
        threads.append(threading.Thread(target=run, args=(rank,)))
        threads[-1].start()
        threads[-1].join(0.3)
    for thread in threads:
        thread.join(TIMEOUT.total_seconds())
    assert not errors, errors
    return results


def test_restarted_ranks_ignore_the_previous_round(agent_store):
    first = _round(3, [0, 1, 2])
    tokens = {token for _, token in first.values()}
    assert len(tokens) == 1 and restart_round() == 0
    first[0][0].set("rank_1_address", "dead")
    # The restarted round: rank 0 starts last, so ranks 1 and 2 read the dead leader first.
    second = _round(3, [2, 1, 0])
    (token,) = {t for _, t in second.values()}
    assert token not in tokens
    assert restart_round() == 1  # the job-wide count, whichever agent restarted
    assert not second[2][0].check(["rank_1_address"])  # the old round's keys are out of sight
    second[1][0].set("rank_1_address", "alive")
    assert second[0][0].get("rank_1_address") == b"alive"
    assert first[0][0].get("rank_1_address") == b"dead"


def test_a_rank_without_rank_0_fails_with_a_message(agent_store):
    with pytest.raises(RuntimeError, match=r"rank 1: rank 0 of this torchrun round did not start"):
        round_store(1, 2, datetime.timedelta(seconds=1))
