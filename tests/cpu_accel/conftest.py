"""The CPU accelerations' own tests run only while the accelerations are on: with
MEGATRON_EXT_CPU_ACCEL=0 (`scripts/test.sh` runs the unit tier so too) the core runs its
portable paths, which the rest of the suite tests. test_boundary runs either way."""

import pytest

from megatron_ext import cpu_accel


def pytest_collection_modifyitems(config, items):
    if cpu_accel.enabled():
        return
    skip = pytest.mark.skip(reason=cpu_accel.OFF)
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if (
            str(item.fspath).startswith(here)
            and item.module.__name__.split(".")[-1] != "test_boundary"
        ):
            item.add_marker(skip)
