"""Which node each rank runs on, and whether the tensor-parallel groups stay inside a node.

megatron-core varies tensor parallelism fastest and torchrun gives each node consecutive ranks,
so with `--nproc-per-node` a multiple of `--tensor-model-parallel-size` every TP group (two
all-reduces per layer) lies within one node. `rank_placement` checks this on the running groups
rather than trusting the arithmetic.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["RankPlace", "node_name", "rank_placement", "tp_groups_spanning_nodes", "describe"]


@dataclass(frozen=True)
class RankPlace:
    """Where one global rank runs and its coordinates in the parallel layout."""

    rank: int
    node: str
    local_rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    tp_group: tuple[int, ...]  # global ranks of this rank's tensor-parallel group


def node_name() -> str:
    """This process's node: torchrun's node index (GROUP_RANK), else Slurm's SLURM_NODEID, else
    the host name (two torchrun agents on one machine are two nodes)."""
    for var, label in (("GROUP_RANK", "node"), ("SLURM_NODEID", "slurm-node")):
        if os.environ.get(var):
            return f"{label} {os.environ[var]}"
    return socket.gethostname()


def rank_placement(groups) -> list[RankPlace]:
    """Every rank's place (gathered over the world; collective), indexed by global rank;
    `groups` is this rank's `ProcessGroups`."""
    mine = RankPlace(
        rank=dist.get_rank(),
        node=node_name(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        **groups.coords(),
        tp_group=tuple(dist.get_process_group_ranks(groups.tp)),
    )
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return table


def tp_groups_spanning_nodes(table: list[RankPlace]) -> list[tuple[int, ...]]:
    """The tensor-parallel groups whose ranks are on more than one node."""
    spanning = {p.tp_group for p in table if len({table[r].node for r in p.tp_group}) > 1}
    return sorted(spanning)


def describe(table: list[RankPlace]) -> list[str]:
    """One line per node: its ranks with their (tp, dp, pp) coordinates."""
    lines = []
    for node in dict.fromkeys(p.node for p in table):
        places = [p for p in table if p.node == node]
        ranks = ", ".join(
            f"rank {p.rank} (local {p.local_rank}: tp {p.tp} dp {p.dp} pp {p.pp})" for p in places
        )
        lines.append(f"{node}: {ranks}")
    return lines
