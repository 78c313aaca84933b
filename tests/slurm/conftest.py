"""The Slurm tests' cluster: a real single-host Slurm (tests.support.slurm), started once per
session (per xdist worker) and stopped after, leaving nothing running."""

from __future__ import annotations

import pytest

from tests.support.slurm import Cluster, missing


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = Cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
    left = cluster.leftovers()
    assert not left, "processes of the test cluster still run after its stop:\n" + "\n".join(left)
