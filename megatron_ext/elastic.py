"""A fresh key space in torchrun's store for every restart round.

Under torchrun the ranks share the agent's TCPStore, which outlives a restart; without a
per-round prefix the restarted ranks find the previous round's keys and connect to dead ranks
(pytorch/pytorch#135712). `TORCHELASTIC_RESTART_COUNT` cannot be the prefix: each agent counts
its own restarts.

`round_store` agrees on a new prefix every round: rank 0 publishes a random token, every other
rank answers it with its own, and proceeds once rank 0 lists its token among the round's
members (a dead rank 0's token is never confirmed). Rank 0 also counts the rounds in the store:
the job-wide restart number (`restart_round`).
"""

from __future__ import annotations

import datetime
import os
import secrets
import time

import torch.distributed as dist

__all__ = ["uses_agent_store", "round_store", "restart_round"]

_ROOT = "leviathan/round"
_POLL_S = 0.05
_round: int | None = None


def uses_agent_store() -> bool:
    """Whether this process is a torchrun worker sharing the agent's TCPStore."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_round() -> int:
    """How many times torchrun has restarted this job's ranks before this round (0 for the first
    round): counted by `round_store` across all agents, else this agent's
    TORCHELASTIC_RESTART_COUNT (0 outside torchrun)."""
    if _round is not None:
        return _round
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def round_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple[dist.Store, str]:
    """Connect to the agent's store (MASTER_ADDR:MASTER_PORT) and return (a PrefixStore that only
    this round's ranks use, the round's token). Raises RuntimeError after `timeout` when the
    ranks do not all arrive."""
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    base = dist.PrefixStore(_ROOT, store)
    token = secrets.token_hex(8)
    if rank == 0:
        base.set("leader", token)
        acks = [f"{token}/ack/{r}" for r in range(1, world_size)]
        if acks:
            base.wait(acks, timeout)
        members = [token, *(base.get(key).decode() for key in acks)]
        count = base.add("rounds", 1) - 1
        base.set(f"{token}/members", f"{count}:" + ",".join(members))
        leader = token
    else:
        leader, count = _join(base, rank, token, timeout)
    global _round
    _round = count
    return dist.PrefixStore(f"{_ROOT}/{leader}", store), leader


def _join(base: dist.Store, rank: int, token: str, timeout: datetime.timedelta) -> tuple[str, int]:
    """Answer whichever leader token is published until one confirms `token`; return it and
    the round's number."""
    deadline = time.monotonic() + timeout.total_seconds()
    answered = None
    while True:
        leader = base.get("leader").decode() if base.check(["leader"]) else None
        if leader is not None:
            if leader != answered:
                base.set(f"{leader}/ack/{rank}", token)
                answered = leader
            members = f"{leader}/members"
            if base.check([members]):
                count, tokens = base.get(members).decode().split(":")
                if token in tokens.split(","):
                    return leader, int(count)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: rank 0 of this torchrun round did not start within "
                f"{timeout.total_seconds():.0f} s"
            )
        time.sleep(_POLL_S)
