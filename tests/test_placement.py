"""megatron_ext.placement on rank tables (the running check is in
tests/training/test_cluster_nodes.py)."""

from megatron_ext.placement import RankPlace, describe, tp_groups_spanning_nodes


def _table(nodes: list[str], tp: int) -> list[RankPlace]:
    """Megatron's order (TP fastest) over ranks placed on `nodes`."""
    return [
        RankPlace(rank=r, node=n, local_rank=nodes[:r].count(n), tp=r % tp, pp=0, cp=0,
                  dp=r // tp, tp_group=tuple(range(r - r % tp, r - r % tp + tp)))
        for r, n in enumerate(nodes)
    ]  # fmt: skip


def test_tp_within_nodes():
    table = _table(["node 0", "node 0", "node 1", "node 1"], tp=2)
    assert tp_groups_spanning_nodes(table) == []
    assert describe(table) == [
        "node 0: rank 0 (local 0: tp 0 dp 0 pp 0), rank 1 (local 1: tp 1 dp 0 pp 0)",
        "node 1: rank 2 (local 0: tp 0 dp 1 pp 0), rank 3 (local 1: tp 1 dp 1 pp 0)",
    ]


def test_tp_across_nodes_is_reported():
    # 3 processes per node with TP=2: the group of ranks 2 and 3 straddles the nodes.
    table = _table(["a"] * 3 + ["b"] * 3, tp=2)
    assert tp_groups_spanning_nodes(table) == [(2, 3)]
    table = _table(["node 0"] * 2 + ["node 1"] * 2, tp=4)
    assert tp_groups_spanning_nodes(table) == [(0, 1, 2, 3)]
